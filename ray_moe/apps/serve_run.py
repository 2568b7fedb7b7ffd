"""``ray-moe serve`` from start to stop: the checks, Ray, the deployment, the Serve app, the state file, the stop.

In order, each before the next starts anything:

1. the options (``--decode-steps``, ``--tensor-parallel-size``, ``--max-model-len``, the API key);
2. **the API address**: a plain bind of ``--host``/``--port`` (``serve_checks.address_taken``). An address
   something listens on is refused naming it and, where it can, its owner (a process, its Ray instance, the
   ``ray-moe serve`` that runs there); the one exception is the joined cluster's own Serve proxy already
   listening there (a job started again after ``ray job stop``), recognised by its Ray instance;
3. ``--device cuda`` on a machine without a GPU per rank (a private instance) fails at once, naming what is
   missing; a deployment name another ``ray-moe serve`` here runs is refused;
4. Ray: a private local instance, or the cluster ``--address`` / ``RAY_ADDRESS`` names (``apps/connect.py``);
   a Serve instance there that would listen elsewhere than ``--host``/``--port`` is refused;
5. the deployment (``Runtime.start``), the Serve app, the state file (``apps/deployments.py``) and the lines
   that say where it runs and which commands reach it (they work as pasted, in a shell with no settings).

SIGINT and SIGTERM (Ctrl-C, ``timeout``, a supervisor, ``kill`` of the process group) stop it: while it starts,
what has started is torn down; while it serves, the Serve app, the deployment and a private Ray instance are
stopped, and the state file removed. A signal sent to the whole process group also reaches the private Ray
instance's own processes, which then die at once: the server sees its Ray gone (its GCS port closed) and exits
without waiting on it, in seconds either way. A second signal while it stops ends it at once.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import threading
import time
from typing import Any, Callable

from ray_moe.apps.connect import join, serve_address
from ray_moe.apps.deployments import find_record, live_records, new_record, remove_record, write_record
from ray_moe.apps.serve_checks import address_taken, check_device, check_max_model_len, port_owner
from ray_moe.apps.serve_flags import DEFAULT_START_TIMEOUT_S
from ray_moe.core.env import EnvSettings, read_env
from ray_moe.core.errors import ConfigError

DTYPES = {"auto": None, "half": "float16", "float": "float32"}

# ``status``'s paths that are not a step kind: how ``ray-moe serve`` names them at start (a step kind: "<kind> steps")
PATH_LABELS = {"long_prompt_attention": "long prompt chunks attend through", "experts": "experts compute through"}


def read_api_key(args: Any, env: Any) -> str | None:
    """The API key: ``--api-key-file PATH`` (its first line, stripped), else ``--api-key``, else
    ``RAY_MOE_API_KEY``; None: no key required."""
    path = getattr(args, "api_key_file", None)
    if path is not None and getattr(args, "api_key", None):
        raise ConfigError("--api-key and --api-key-file: pass one of them")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as fh:
                key = fh.read().strip()
        except OSError as exc:
            raise ConfigError(f"--api-key-file={path!r}: {exc.strerror or exc}") from None
        if not key or any(ch.isspace() for ch in key):
            raise ConfigError(f"--api-key-file={path!r}: the file must hold one key (no spaces), got "
                              f"{'nothing' if not key else 'several words'}")
        return key
    return getattr(args, "api_key", None) or env.api_key


def serve_http_conflict(host: str, port: int) -> str | None:
    """Why the Serve instance already running on this cluster would not listen where ``--host``/``--port`` say
    (Serve keeps one HTTP address per cluster and ignores a new one); None when none runs or it matches."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    have = client.http_config
    if (str(have.host), int(have.port)) == (str(host), int(port)):
        return None
    return (f"a Ray Serve instance already runs on this cluster, listening on {have.host}:{have.port}; it would not "
            f"honour --host {host} --port {port} (Serve keeps one HTTP address per cluster): stop it first "
            f"(`serve shutdown`), or pass --host {have.host} --port {have.port}")


def _url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def address_refusal(host: str, port: int, state_dir: str) -> str:
    """The error for an API address something already listens on: who holds it, where this can tell."""
    owner = port_owner(port)
    who = ""
    if owner is not None:
        who = f" by {owner.describe()}"
        servers = [r for r in live_records(state_dir) if owner.gcs_address and r.gcs_address == owner.gcs_address]
        if servers:
            r = servers[0]
            who += f": the Ray Serve proxy of ray-moe serve pid {r.pid}, deployment {r.name!r} on {r.url}"
    return (f"--host {host} --port {port}: the address is already in use{who}. A server never shares its address "
            f"(requests would be split between the two): pass another --port, or stop that server first")


def _head_is_here() -> bool:
    """Whether the joined cluster's head node (where Serve's proxy listens) is this machine."""
    import ray

    here = ray.util.get_node_ip_address()
    heads = [n for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})]
    return not heads or any(n.get("NodeManagerAddress") == here for n in heads)


def _held_by_this_cluster(host: str, port: int, gcs: str) -> bool:
    """Whether the process on the address is this cluster's own Serve proxy (listening there already), or the
    address is not on this machine at all (the proxy runs on the head node)."""
    if not _head_is_here():
        return True
    owner = port_owner(port)
    if owner is not None:
        return owner.gcs_address == gcs
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)  # whom we cannot see: Serve's own config
    return client is not None and (str(client.http_config.host), int(client.http_config.port)) == (host, int(port))


def gcs_alive(gcs: str | None, timeout_s: float = 1.0) -> bool:
    if not gcs:
        return False
    host, _, port = gcs.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _bounded(fn: Callable[[], Any], seconds: float) -> bool:
    """Run ``fn`` for at most ``seconds`` (on a daemon thread); whether it finished."""
    th = threading.Thread(target=lambda: _quiet(fn), daemon=True)
    th.start()
    th.join(seconds)
    return not th.is_alive()


def _quiet(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass


class SignalGuard:
    """SIGINT / SIGTERM while serving: stop (``done``); while starting: unwind (KeyboardInterrupt, so what started
    is torn down); a second signal while stopping: KeyboardInterrupt, at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, done: threading.Event, gone: Callable[[], bool] = lambda: False) -> None:
        self.done, self.serving, self.received, self.gone = done, False, None, gone
        self.saved = {s: signal.getsignal(s) for s in self.SIGNALS}
        self.install()

    def install(self) -> None:  # again after Ray and Serve started (they may set their own)
        for s in self.SIGNALS:
            signal.signal(s, self._on)

    def _on(self, signum: int, frame: Any) -> None:
        first = self.received is None
        self.received = signum
        self.done.set()
        if not self.serving and self.gone():  # starting, and the signal killed the private Ray instance too
            print(f"ray-moe serve: stopped ({signal.Signals(signum).name}) while starting; its Ray instance had "
                  f"stopped already", flush=True)
            os._exit(128 + signum)
        if not self.serving or not first:
            raise KeyboardInterrupt

    def restore(self) -> None:
        for s, h in self.saved.items():
            try:
                signal.signal(s, h)
            except (TypeError, ValueError):
                pass


def _commands(name: str, ranks: int, env: EnvSettings) -> list[str]:
    """What the user types in another shell to reach this deployment (no settings needed: the state file)."""
    prefix = "" if env.state_dir_default else f"RAY_MOE_STATE_DIR={shlex.quote(env.state_dir)} "
    n = shlex.quote(name)
    return [f"{prefix}ray-moe status --name {n}",
            f"{prefix}ray-moe scale --name {n} --expert 0 --replicas {min(2, ranks)}"]


def preflight(args: Any, env: EnvSettings) -> tuple[str | None, bool, OSError | None]:
    """The checks that need no Ray (items 1-3 of the module docstring): (the API key, whether the server will
    start a private Ray instance, the error a bind of the address met when something listens there but the
    joined cluster's own Serve proxy may be the one). ``ConfigError`` naming the flag for the rest."""
    import sys

    decode_steps = getattr(args, "decode_steps", None)
    if decode_steps is not None and not 1 <= decode_steps <= 64:
        raise ValueError(f"--decode-steps={decode_steps}: must be in [1, 64]")
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None and tp != 1:
        raise ConfigError(f"--tensor-parallel-size={tp}: ray-moe runs data-parallel attention with expert "
                          f"parallelism over its ranks, not tensor parallelism: pass --data-parallel-size {tp}")
    api_key = read_api_key(args, env)
    try:
        check_max_model_len(getattr(args, "max_model_len", None), args.checkpoint)
        taken = address_taken(args.host, args.port)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    ray = sys.modules.get("ray")
    private = serve_address(args, env) is None and not (ray is not None and ray.is_initialized())
    if taken is not None and private:
        raise ConfigError(address_refusal(args.host, args.port, env.state_dir))
    if private:
        try:
            check_device(args.device, args.ranks)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    other = find_record(env.state_dir, args.name)
    if other is not None and other.pid != os.getpid():
        raise ConfigError(f"--name {args.name}: a ray-moe serve on this machine already runs a deployment of that "
                          f"name (pid {other.pid}, {other.url}, Ray at {other.gcs_address}): pass another --name")
    return api_key, private, taken


def serve_main(args: Any, build_app: Callable[..., Any], *, ready: threading.Event | None = None,
               stop: threading.Event | None = None, config_fields: dict | None = None) -> int:
    """``run_server``: see the module docstring. ``stop``: an event that stops it (no signal handlers then);
    ``config_fields``: more RuntimeConfig fields (the CLI's elasticity flags), else ``--eplb`` alone."""
    env = read_env()
    api_key, private, taken = preflight(args, env)
    decode_steps, max_model_len = getattr(args, "decode_steps", None), getattr(args, "max_model_len", None)
    address = serve_address(args, env)
    import ray

    in_process = ray.is_initialized()
    from ray_moe.model.config import RuntimeConfig

    dtype = DTYPES.get(args.dtype, args.dtype) if args.dtype else None
    dtype = dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if config_fields is None:
        config_fields = {"eplb": args.eplb} if getattr(args, "eplb", None) is not None else {}
    cfg = RuntimeConfig.from_pretrained(args.checkpoint, num_ranks=args.ranks, device=args.device, dtype=dtype,
                                        name=args.name, **config_fields)
    done = stop or threading.Event()
    state = {"rt": None, "app": None, "record": False, "started_ray": False, "gcs": None}
    guard = (SignalGuard(done, lambda: state["started_ray"] and private_ray_gone(state["gcs"], 1.0))
             if stop is None and threading.current_thread() is threading.main_thread() else None)
    try:
        _start(args, cfg, env, api_key, max_model_len, build_app, private, in_process, address, taken, state,
               decode_steps)
        if ready is not None:
            ready.set()
        if guard is not None:
            guard.install()
            guard.serving = True
        while not done.wait(0.5):
            pass
    finally:
        gone = _teardown(state, owned=stop is None)
        if state["record"]:
            remove_record(env.state_dir, cfg.name, os.getpid())
        if guard is not None:
            guard.restore()
    why = {signal.SIGTERM: " (SIGTERM)", signal.SIGINT: " (SIGINT)"}.get(guard.received if guard else None, "")
    print(f"ray-moe serve: stopped{why}" + ("; its Ray instance had stopped already (the signal reached its "
                                            "processes too)" if gone else ""), flush=True)
    if gone and stop is None:  # this process's Ray client cannot shut down without its GCS (Ray would wait 60 s)
        import sys

        sys.stderr.flush()
        os._exit(0)
    return 0


def _start(args: Any, cfg: Any, env: EnvSettings, api_key: str | None, max_model_len: int | None,
           build_app: Callable[..., Any], private: bool, in_process: bool, address: str | None,
           taken: OSError | None, state: dict, decode_steps: int | None) -> None:
    import ray
    from ray import serve

    from ray_moe.runtime import Runtime

    if private:  # a private local instance, stopped with this process
        ray.init(address="local", include_dashboard=False, log_to_driver=False, namespace=env.namespace)
        state["started_ray"] = True
    elif not in_process:
        join(address, env)
    state["gcs"] = gcs = ray.get_runtime_context().gcs_address
    if taken is not None and not _held_by_this_cluster(args.host, args.port, gcs):
        raise ConfigError(address_refusal(args.host, args.port, env.state_dir))
    conflict = serve_http_conflict(args.host, args.port)
    if conflict is not None:
        raise ConfigError(conflict)
    state["rt"] = rt = Runtime.start(cfg, timeout_s=getattr(args, "start_timeout", DEFAULT_START_TIMEOUT_S))
    model_name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    url = _url(args.host, args.port)
    auth = "token" if (read_env().ray_auth_mode or "").lower() == "token" else "disabled"
    # the state file, as soon as the deployment runs: status / scale / rebalance find it from here on
    write_record(env.state_dir, new_record(name=cfg.name, gcs_address=gcs, auth_mode=auth, url=url, model=model_name,
                                           namespace=ray.get_runtime_context().namespace,
                                           ray="private" if state["started_ray"] else "joined"))
    state["record"] = True
    has_tok = any(os.path.exists(os.path.join(args.checkpoint, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    # the product's defaults (``driver/defaults.py``) unless a flag says otherwise: None step_tokens / max_running /
    # decode_steps
    serving = dict(kv_tokens=getattr(args, "kv_tokens", None), block_size=getattr(args, "block_size", 16),
                   step_tokens=getattr(args, "step_tokens", None), max_running=getattr(args, "max_running", None),
                   max_queued=getattr(args, "max_queued", 1024), decode_steps=decode_steps,
                   fused_kernels=getattr(args, "fused_kernels", True), attention=getattr(args, "attention", "auto"),
                   memory_fraction=getattr(args, "memory_fraction", None),
                   prefix_caching=getattr(args, "prefix_caching", True))
    app_name = f"ray-moe-{args.name}"
    # one proxy, on the head node, at --host only (never every node's interfaces)
    serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="HeadOnly")
    server = build_app(model_name, cfg.name, api_key=api_key, tokenizer_folder=args.checkpoint if has_tok else None,
                       serving=serving, max_model_len=max_model_len)
    state["app"] = app_name
    handle = serve.run(server.bind(), name=app_name, route_prefix="/", blocking=False)  # (returns once it serves)
    notes = handle.start_notes.remote().result(timeout_s=1800)  # (at once: the replica has started its engine)
    lines = [f"ray-moe serve: {model_name!r} on {url} ({args.ranks} ranks, deployment {cfg.name!r}"
             f"{', API key required' if api_key else ''}); Ctrl-C stops",
             f"  {notes['capacity']}", *[f"  {PATH_LABELS.get(kind, kind.replace('_', ' ') + ' steps')}: {path}"
                                          for kind, path in notes.get("paths", {}).items()],
             *[f"  warning: {w}" for w in notes["warnings"]],
             f"  Ray: {gcs} ("
             f"{'a private instance started here: it stops with this process' if state['started_ray'] else 'joined'})",
             "  from another shell:", *[f"    {c}" for c in _commands(cfg.name, args.ranks, env)],
             "  (and, once it has served traffic, ray-moe rebalance: an EPLB rebalance from the observed load)"]
    if not state["started_ray"]:
        lines.append(f"  from another machine: RAY_ADDRESS={gcs} ray-moe status --name {shlex.quote(cfg.name)} "
                     f"(with the cluster's token: `ray get-auth-token` on its head node)")
    print("\n".join(lines), flush=True)


def private_ray_gone(gcs: str | None, wait_s: float = 1.5) -> bool:
    """Whether the private Ray instance this process started has lost its GCS or raylet (a signal sent to the
    whole process group reaches them too), waiting up to ``wait_s`` for them to finish dying."""
    try:  # the processes ray.init started (private API: else the GCS port alone says)
        from ray._private import worker

        procs = [info.process for kind in ("gcs_server", "raylet")
                 for info in worker._global_node.all_processes.get(kind, [])]
    except Exception:  # noqa: BLE001
        procs = []
    deadline = time.monotonic() + wait_s
    while True:
        if any(p.poll() is not None for p in procs) or not gcs_alive(gcs, timeout_s=0.5):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _teardown(state: dict, *, owned: bool) -> bool:
    """Stop what ``_start`` started; True when a private Ray instance was found gone already (then nothing is
    waited on: its processes, and with them the deployment's actors, are dead)."""
    import ray

    if not ray.is_initialized():
        return False
    if state["started_ray"] and private_ray_gone(state["gcs"]):
        return True
    if state["app"] is not None and not state["started_ray"]:  # (a private instance's Serve stops with it)
        from ray import serve

        _bounded(lambda: serve.delete(state["app"]), 20.0)
    rt = state["rt"]
    if rt is not None:
        rt.shutdown()
    if state["started_ray"] or (owned and rt is not None and rt.owns_ray):
        ray.shutdown()
    return False


__all__ = ["SignalGuard", "address_refusal", "gcs_alive", "read_api_key", "serve_http_conflict", "serve_main"]

