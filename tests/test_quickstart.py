"""The README's serving quickstart, run as pasted (bash, a fresh local Ray instance, the openai client)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_block() -> str:
    text = README.read_text(encoding="utf-8")
    m = re.search(r"<!-- quickstart:[^>]*-->\s*```bash\n(.*?)```", text, re.S)
    assert m, "README.md: the quickstart block (<!-- quickstart ... --> then a bash block) is missing"
    return m.group(1)


def test_the_block_is_complete():
    block = quickstart_block()
    for needed in ("ray-moe serve", "completions.create", "chat.completions.create", "kill %1"):
        assert needed in block, needed


@pytest.mark.timeout(300)
def test_readme_quickstart_runs_as_pasted(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    block = quickstart_block()
    # the install line is this checkout's own install (done by CI); everything after it runs verbatim
    lines = block.splitlines()
    assert lines[0].startswith("pip install")
    script = "\n".join(["set -euo pipefail", *lines[1:]])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PORT": str(port), "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"completion: '.*' CompletionUsage\(completion_tokens=8, prompt_tokens=13, total_tokens=21", out), out[-3000:]
    assert re.search(r"chat: ['\"]", out), out[-3000:]  # (sampled at temperature 1: the text may hold a quote)
    assert (tmp_path / "tiny-moe" / "config.json").exists()
