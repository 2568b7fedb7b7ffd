"""The import-layering contract (ARCHITECTURE.md): packages by stage, imports only downward, no circles.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING``; so does an import by name at run
time (``importlib.import_module`` / ``__import__``: a literal name is checked as an import, a name computed at run
time cannot be checked and is refused outside ``DYNAMIC_ALLOWED``), and an import of the package root ``ray_moe``
(it re-exports ``Runtime``: it sits at the runtime layer). The first violation fails with the importing file, its
line and the rule it breaks. ARCHITECTURE.md's layout names every product module (a module added without its line
there fails).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ROOT / "ray_moe"

# lowest first; packages on one line are peers (neither may import the other)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("placement",),
    ("moe",),
    ("model",),
    ("shard", "control"),
    ("driver", "release"),
    ("ray",),
    ("runtime",),
    ("apps",),
)
# the only places that may import Ray: its own layer and the ones above it
RAY_ALLOWED = {"ray", "runtime", "apps"}
# the development packages the product must never import
DEV_PACKAGES = ("ray_moe_dev", "ray_moe_bench")
# the package root re-exports ``Runtime`` (lazily): importing it is importing the runtime layer
ROOT_LAYER = "runtime"
# modules that may import a name computed at run time: each a lazy-exports table (``_EXPORTS``: a module-level dict
# literal) whose every target must be a module of the given package (checked)
DYNAMIC_ALLOWED = {"ray_moe/model/__init__.py": "ray_moe.model."}
DYNAMIC = "<a module named at run time>"
# known circles left for their owners, each with the fix (a circle not listed here, or listed and gone, fails)
KNOWN_CIRCLES: set[str] = set()  # (none left: a circle found is a failure)


def layer_of(module: str) -> int | None:
    """The layer index of ``ray_moe.X...`` (None for the package root ``ray_moe`` itself)."""
    parts = module.split(".")
    if parts[0] != "ray_moe" or len(parts) == 1:
        return None
    return _layer(parts[1])


def _layer(top: str) -> int:
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"package {top!r} is in no layer of tests/test_layers.py")


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path = ROOT, known: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``path``, relative imports resolved; ``from pkg import
    mod`` of a known submodule counts as importing ``pkg.mod`` (not the package's own ``__init__``), except inside
    ``pkg`` itself: there it reads from the package's namespace, and counts as importing ``pkg`` too (its
    ``__init__`` importing that module back is a circle)."""
    mod = module_name(path, root)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and _imports_by_name(node.func):
            out.append((node.lineno, _named(node.args[0] if node.args else None)))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            subs = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in known]
            out += [(node.lineno, s) for s in subs]
            inside = mod != name and (mod + ".").startswith(name + ".")
            if len(subs) < len(node.names) or (subs and inside):
                out.append((node.lineno, name))
    return out


def _imports_by_name(func: ast.expr) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    return ((isinstance(func, ast.Attribute) and func.attr == "import_module")
            or (isinstance(func, ast.Name) and func.id in ("import_module", "__import__")))


def _named(arg: ast.expr | None) -> str:
    """The module an import by name reaches: a literal, the package an f-string's literal head names, or
    ``DYNAMIC``."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        if "." in head:
            return head.rsplit(".", 1)[0]
    return DYNAMIC


def _exports_within(path: Path, package: str) -> list[str]:
    """The targets of ``path``'s module-level ``_EXPORTS`` dict literal that are not modules of ``package``
    (every one must be); a file without such a literal: ['(no _EXPORTS table)']."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return [v.value for v in node.value.values
                    if not (isinstance(v, ast.Constant) and str(v.value).startswith(package))]
    return ["(no _EXPORTS table)"]


def violations(root: Path = ROOT, product: str = "ray_moe") -> list[str]:
    """Every broken rule in the product package under ``root``, as 'file:line: why'."""
    found: list[str] = []
    files = sorted((root / product).rglob("*.py"))
    known = {module_name(f, root) for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:
        mod = module_name(f, root)
        mine = layer_of(mod)
        top = mod.split(".")[1] if "." in mod else ""
        for line, name in imports(f, root, frozenset(known)):
            where = f"{f.relative_to(root)}:{line}"
            if name == DYNAMIC:
                rel = f.relative_to(root).as_posix()
                if rel in DYNAMIC_ALLOWED:
                    bad = _exports_within(f, DYNAMIC_ALLOWED[rel])
                    if bad:
                        found.append(f"{where}: imports by name at run time, and its _EXPORTS reach outside "
                                     f"{DYNAMIC_ALLOWED[rel]}: {bad}")
                else:
                    found.append(f"{where}: imports a module named at run time (importlib / __import__): its layer "
                                 f"cannot be checked; import it by name")
                continue
            if name == product and mine is not None and mine < _layer(ROOT_LAYER):
                found.append(f"{where}: {mod} (layer {'/'.join(LAYERS[mine])}) imports the package root {product}, "
                             f"which re-exports Runtime (layer {ROOT_LAYER}): import the module that defines it")
                continue
            if name.split(".")[0] in DEV_PACKAGES:
                found.append(f"{where}: imports the development package {name} (the product never does)")
            if name.split(".")[0] == "ray" and top not in RAY_ALLOWED:
                found.append(f"{where}: imports Ray outside ray_moe.ray / runtime / apps ({name})")
            if not name.startswith(product + ".") or name not in known:
                continue
            graph.setdefault(mod, set()).add(name)
            theirs = layer_of(name)
            if mine is None or theirs is None:
                continue
            if theirs > mine:
                found.append(f"{where}: {mod} (layer {'/'.join(LAYERS[mine])}) imports {name} from the higher "
                             f"layer {'/'.join(LAYERS[theirs])}")
            elif theirs == mine and name.split(".")[1] != top:
                found.append(f"{where}: {mod} imports its peer package {name} ({'/'.join(LAYERS[mine])} "
                             f"packages are independent)")
    found += [f"import circle: {' -> '.join(c)}" for c in cycles(graph)]
    return found


def test_known_circles_are_still_there():
    """A known circle that is gone must leave ``KNOWN_CIRCLES`` (so the list never hides a new one)."""
    circles = {v.removeprefix("import circle: ") for v in violations() if v.startswith("import circle: ")}
    assert KNOWN_CIRCLES <= circles, f"fixed, drop from KNOWN_CIRCLES: {sorted(KNOWN_CIRCLES - circles)}"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), closed (first == last)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                out.append(_circle(graph, sorted(group)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _circle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest circle from the group's first module back to itself."""
    start, members = group[0], set(group)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in members and w not in prev and w != start:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return group + [group[0]]


def test_product_imports_only_downward_and_has_no_circles():
    found = [v for v in violations() if v.removeprefix("import circle: ") not in KNOWN_CIRCLES]
    assert not found, "import layering broken:\n" + "\n".join(found)


def test_the_check_fails_on_an_upward_import_and_on_a_circle(tmp_path):
    """The contract is not vacuous: an upward import, a Ray import in a pure layer, a development import and
    a circle planted in a copy of a tiny tree are each reported."""
    pkg = tmp_path / "ray_moe"
    for sub in ("core", "placement", "moe"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from ray_moe.placement.b import X\n")  # upward
    (pkg / "placement" / "b.py").write_text("import ray\nX = 1\n")  # Ray in a pure layer
    (pkg / "moe" / "c.py").write_text("from ray_moe.moe.d import Y\nimport ray_moe_dev.testing\n")
    (pkg / "moe" / "d.py").write_text("from ray_moe.moe.c import Z\n")  # circle c -> d -> c
    found = violations(tmp_path)
    assert any("ray_moe/core/a.py:1" in v and "higher layer placement" in v for v in found), found
    assert any("ray_moe/placement/b.py:1" in v and "imports Ray" in v for v in found), found
    assert any("development package ray_moe_dev.testing" in v for v in found), found
    assert any(v == "import circle: ray_moe.moe.c -> ray_moe.moe.d -> ray_moe.moe.c" for v in found), found
    (pkg / "core" / "a.py").write_text("X = 0\n")
    (pkg / "placement" / "b.py").write_text("from ray_moe.core.a import X\n")
    (pkg / "moe" / "c.py").write_text("from ray_moe.moe.d import Y\n")
    (pkg / "moe" / "d.py").write_text("Y = 1\n")
    assert violations(tmp_path) == []


def test_the_check_fails_on_a_root_import_and_on_an_import_by_name(tmp_path):
    """Issue 42: ``from ray_moe import Runtime`` planted in ``core/`` and ``importlib.import_module`` in a lower layer
    used to pass. The root re-exports Runtime (the runtime layer): a lower layer importing it is upward; an import by a
    literal name is checked as the import it is (upward here, a development package there); a name computed at run
    time is refused (outside the lazy-exports tables of ``DYNAMIC_ALLOWED``, whose targets are checked)."""
    pkg = tmp_path / "ray_moe"
    for sub in ("core", "placement", "model", "apps"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime.py").write_text("X = 1\n")
    (pkg / "core" / "a.py").write_text("from ray_moe import Runtime\n")  # the root, from the lowest layer
    (pkg / "core" / "b.py").write_text("import ray_moe\n")
    (pkg / "placement" / "c.py").write_text(
        "import importlib\n\ndef f(name):\n    importlib.import_module('ray_moe.apps.cli')\n"
        "    return importlib.import_module(name)\n")
    (pkg / "placement" / "d.py").write_text("def g():\n    return __import__('ray_moe.runtime')\n")
    (pkg / "apps" / "e.py").write_text(
        "from importlib import import_module\nimport ray_moe\n\ndef h(n):\n"
        "    return import_module(f'ray_moe_bench.{n}')\n")
    (pkg / "apps" / "cli.py").write_text("")
    (pkg / "model" / "__init__.py").write_text(
        "import importlib\n_EXPORTS = {'A': 'ray_moe.model.a', 'B': 'ray_moe.apps.cli'}\n\n"
        "def __getattr__(n):\n    return importlib.import_module(_EXPORTS[n])\n")
    found = violations(tmp_path)
    assert any("ray_moe/core/a.py:1" in v and "imports the package root ray_moe" in v for v in found), found
    assert any("ray_moe/core/b.py:1" in v and "imports the package root ray_moe" in v for v in found), found
    assert any("ray_moe/placement/c.py:4" in v and "imports ray_moe.apps.cli from the higher layer apps" in v
               for v in found), found
    assert any("ray_moe/placement/c.py:5" in v and "named at run time" in v for v in found), found
    assert any("ray_moe/placement/d.py:2" in v and "higher layer runtime" in v for v in found), found
    assert any("ray_moe/apps/e.py:5" in v and "development package ray_moe_bench" in v for v in found), found
    assert not any("ray_moe/apps/e.py:2" in v for v in found), found  # apps sits above the root: allowed
    assert any("ray_moe/model/__init__.py:5" in v and "reach outside ray_moe.model.: ['ray_moe.apps.cli']" in v
               for v in found), found
    (pkg / "model" / "__init__.py").write_text(
        "import importlib\n_EXPORTS = {'A': 'ray_moe.model.a'}\n\ndef __getattr__(n):\n"
        "    return importlib.import_module(_EXPORTS[n])\n")
    for f in ("core/a.py", "core/b.py", "placement/c.py", "placement/d.py", "apps/e.py"):
        (pkg / f).write_text("")
    assert violations(tmp_path) == []


def test_a_module_reading_its_own_package_that_imports_it_is_a_circle(tmp_path):
    """Inside a package, ``from pkg import sub`` reads the package's namespace: with ``pkg/__init__`` importing that
    module (even inside a function) it is a circle (issue 42: apps/drill, moe/experts/runners); outside the package
    it is an import of ``pkg.sub`` alone."""
    pkg = tmp_path / "ray_moe"
    (pkg / "apps" / "drill").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "apps" / "__init__.py").write_text("")
    (pkg / "apps" / "drill" / "__init__.py").write_text("from ray_moe.apps.drill.run import go\n")
    (pkg / "apps" / "drill" / "run.py").write_text("def go():\n    from ray_moe.apps.drill import probes\n")
    (pkg / "apps" / "drill" / "probes.py").write_text("")
    (pkg / "apps" / "cli.py").write_text("from ray_moe.apps.drill import probes\n")  # outside: no circle
    assert violations(tmp_path) == [
        "import circle: ray_moe.apps.drill -> ray_moe.apps.drill.run -> ray_moe.apps.drill"]
    (pkg / "apps" / "drill" / "run.py").write_text("def go():\n    from ray_moe.apps.drill.probes import x\n")
    assert violations(tmp_path) == []


@pytest.mark.parametrize("limit", [600])
def test_no_product_module_is_oversized(limit):
    big = {str(f.relative_to(ROOT)): n for f in PRODUCT.rglob("*.py")
           if (n := len(f.read_text(encoding="utf-8").splitlines())) > limit}
    assert not big, f"product modules over {limit} lines: {big}"


# ------------------------------------------------------------------ ARCHITECTURE.md names every module
ARCHITECTURE = ROOT / "ARCHITECTURE.md"


def layout_entries(text: str) -> dict[str, str]:
    """{top-level entry (``core``, ``runtime.py``): its text} from ARCHITECTURE.md's layout block: the first code
    block, where an entry starts two spaces in (``  core/`` or ``  runtime.py``) and runs over the lines indented
    deeper."""
    block = text.split("```", 2)[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        m = re.match(r"  ([a-z_]+)(/|\.py)\s", line + " ")
        if m:
            current = m.group(1) if m.group(2) == "/" else m.group(1) + ".py"
            entries[current] = line[len(m.group(0)) - 1:]
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line.strip()
    return entries


def unnamed_modules(root: Path = ROOT, doc: Path = ARCHITECTURE, product: str = "ray_moe") -> list[str]:
    """The product modules the layout block does not name: ``<pkg>/<sub>/.../<mod>.py`` must have an entry for
    ``<pkg>`` whose text names each sub-package (``sub/``) and the module (``mod``, as a word); a top-level
    module (``runtime.py``) must have an entry of its own. ``__init__.py`` files are their package."""
    entries = layout_entries(doc.read_text(encoding="utf-8"))
    missing = []
    for f in sorted((root / product).rglob("*.py")):
        rel = f.relative_to(root / product)
        if f.name == "__init__.py":
            continue
        if len(rel.parts) == 1:
            if rel.name not in entries:
                missing.append(str(rel))
            continue
        text = entries.get(rel.parts[0])
        words = [f"{p}/" for p in rel.parts[1:-1]] + [rel.stem]
        if text is None or not all(re.search(rf"(?<![\w/]){re.escape(w)}(?![\w])", text) for w in words):
            missing.append(str(rel))
    return missing


def test_architecture_names_every_product_module():
    missing = unnamed_modules()
    assert not missing, ("ARCHITECTURE.md's layout does not name these modules (add each to its package's entry, "
                         "with what it does): " + ", ".join(missing))
    entries = layout_entries(ARCHITECTURE.read_text(encoding="utf-8"))
    assert set(entries) == {name for layer in LAYERS for name in layer} - {"runtime"} | {"runtime.py"}


def test_the_architecture_check_fails_on_a_module_it_does_not_name(tmp_path):
    pkg = tmp_path / "ray_moe"
    (pkg / "shard").mkdir(parents=True)
    (pkg / "moe" / "dispatch").mkdir(parents=True)
    for f in ("shard/core.py", "shard/lattice.py", "moe/dispatch/engine.py", "moe/dispatch/plan.py", "runtime.py",
              "shard/__init__.py"):
        (pkg / f).write_text("")
    doc = tmp_path / "ARCHITECTURE.md"
    doc.write_text("x\n```\n  moe/        dispatch/ (engine, the reference)\n"
                   "  shard/      one rank: core (pin, step),\n"
                   "              lattice (shapes)\n  runtime.py  the facade\n```\n")
    assert unnamed_modules(tmp_path, doc) == ["moe/dispatch/plan.py"]
    (pkg / "apps").mkdir()
    (pkg / "apps" / "vocab.py").write_text("")
    (pkg / "ray").mkdir()
    (pkg / "ray" / "fleet.py").write_text("")
    assert unnamed_modules(tmp_path, doc) == ["apps/vocab.py", "moe/dispatch/plan.py", "ray/fleet.py"]
