"""The deployments ``ray-moe serve`` runs on this machine, one small state file each (pure: files and ``/proc``).

``ray-moe serve`` writes ``<state dir>/<name>.json`` (``$RAY_MOE_STATE_DIR``, else ``~/.ray-moe``; readable by
this user only) once its API answers, and removes it when it stops: the deployment's name, the Ray instance it
runs on (GCS address, namespace, whether token authentication is on), the API's URL, the model, and the server's
process (pid and start time). ``ray-moe status`` / ``scale`` / ``rebalance`` without ``--address`` read these
files to reach the deployment the user started, never whatever other Ray cluster runs on the machine. A file
whose process is gone (killed, a crash) is stale: ``live_records`` ignores and removes it.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_VERSION = 1


@dataclass(frozen=True)
class DeploymentRecord:
    """One running ``ray-moe serve``: where its deployment and its API are."""

    name: str
    gcs_address: str
    namespace: str
    auth_mode: str  # "token" or "disabled": what a client must send to reach gcs_address
    url: str  # the API, http://host:port/v1
    model: str
    ray: str  # "private" (started by the server, stops with it) or "joined"
    pid: int
    pid_start: str | None = None  # the process's start time (/proc/<pid>/stat), against a reused pid
    started: float = 0.0
    version: int = STATE_VERSION


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (None where ``/proc`` cannot say)."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def alive(rec: DeploymentRecord) -> bool:
    """Whether the server that wrote ``rec`` still runs (the same process, not a reused pid)."""
    try:
        os.kill(rec.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process holds the pid: not ours
    start = process_start(rec.pid)
    return rec.pid_start is None or start is None or start == rec.pid_start


def record_path(state_dir: str | os.PathLike, name: str) -> Path:
    return Path(state_dir) / f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.json"


def write_record(state_dir: str | os.PathLike, rec: DeploymentRecord) -> Path:
    """Write ``rec`` atomically (a temporary file renamed), readable by this user only."""
    folder = Path(state_dir)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = record_path(folder, rec.name)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(asdict(rec), fh, indent=1)
    os.replace(tmp, path)
    return path


def read_record(path: Path) -> DeploymentRecord | None:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        return DeploymentRecord(**{k: body[k] for k in DeploymentRecord.__dataclass_fields__ if k in body})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def remove_record(state_dir: str | os.PathLike, name: str, pid: int | None = None) -> None:
    """Remove ``name``'s file (only the one ``pid`` wrote, when given)."""
    path = record_path(state_dir, name)
    rec = read_record(path)
    if rec is not None and pid is not None and rec.pid != pid:
        return
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def live_records(state_dir: str | os.PathLike) -> list[DeploymentRecord]:
    """The deployments whose server still runs, by name; stale files are removed."""
    folder = Path(state_dir)
    out = []
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError:
        return []
    for path in paths:
        rec = read_record(path)
        if rec is None:
            continue
        if not alive(rec):
            try:
                path.unlink()
            except OSError:
                pass
            continue
        out.append(rec)
    return sorted(out, key=lambda r: r.name)


def find_record(state_dir: str | os.PathLike, name: str) -> DeploymentRecord | None:
    return next((r for r in live_records(state_dir) if r.name == name), None)


def new_record(**fields) -> DeploymentRecord:
    pid = os.getpid()
    return DeploymentRecord(pid=pid, pid_start=process_start(pid), started=time.time(), **fields)


__all__ = ["DeploymentRecord", "alive", "find_record", "live_records", "new_record", "read_record",
           "record_path", "remove_record", "write_record"]
