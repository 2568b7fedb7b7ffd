"""What ``ray-moe serve`` checks before Ray or any shard starts (pure: sockets, ``/proc`` and the checkpoint's
``config.json``; no Ray).

* ``address_taken(host, port)``: a plain bind of the API address (``SO_REUSEADDR``, as the server's own socket,
  never ``SO_REUSEPORT``, which would let two servers share the port and split its requests), closed again. An
  address something listens on is refused, and ``port_owner`` says who holds it where it can: the listening
  socket's inode from ``/proc/net/tcp`` / ``tcp6``, the process whose ``/proc/<pid>/fd`` holds that socket
  (this user's processes only), its command line, and, for a Ray worker (a Serve proxy), the Ray instance it
  belongs to (the ``--gcs-address`` of the raylet above it).
* ``check_device(device, ranks)``: ``--device cuda`` with no CUDA GPU (or fewer than the ranks) on this machine
  fails at once, naming what is missing.
* ``model_context(folder)`` / ``check_max_model_len``: ``--max-model-len`` within the model's positions.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # the TCP state column of /proc/net/tcp for a listening socket


@dataclass(frozen=True)
class PortOwner:
    """Who listens on an address: a process, its command line and, for a Ray process, its Ray instance."""

    pid: int
    command: str
    gcs_address: str | None = None

    def describe(self) -> str:
        out = f"pid {self.pid} ({self.command})"
        if self.gcs_address:
            out += f", a process of the Ray instance at {self.gcs_address}"
        return out


def address_taken(host: str, port: int) -> OSError | None:
    """The error a bind of (host, port) meets when something already listens there (None: free). Raises
    ``ValueError`` for a host that is not an address of this machine or a port this user may not bind."""
    if not 0 < int(port) < 65536:
        raise ValueError(f"--port={port}: must be in [1, 65535]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host={host!r}: {exc.strerror or exc}") from None
    seen = set()
    for family, kind, proto, _, addr in infos:
        if (family, addr) in seen:
            continue
        seen.add((family, addr))
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return exc
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise ValueError(f"--host={host!r}: not an address of this machine") from None
                if exc.errno == errno.EACCES:
                    raise ValueError(f"--port={port}: this user may not listen on it (a port below 1024 needs "
                                     f"privileges)") from None
                raise
    return None


def _listening_inodes(port: int, proc: Path) -> list[int]:
    out = []
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != LISTEN:
                continue
            _, _, hexport = cols[1].rpartition(":")
            if int(hexport, 16) == int(port):
                out.append(int(cols[9]))
    return out


def _cmdline(pid: int, proc: Path) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(raw.decode(errors="replace").replace("\0", " ").split()) or "?"


def _parent(pid: int, proc: Path) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
    return int(fields[1]) if len(fields) > 1 else None


def _gcs_of(pid: int, proc: Path) -> str | None:
    """The ``--gcs-address`` of the process or of the nearest ancestor that names one (a Ray worker's raylet)."""
    for _ in range(8):
        for arg in _cmdline(pid, proc).split():
            if arg.startswith("--gcs-address=") or arg.startswith("--gcs_address="):
                return arg.split("=", 1)[1]
        parent = _parent(pid, proc)
        if not parent or parent == pid:
            return None
        pid = parent
    return None


def port_owner(port: int, *, proc: Path = Path("/proc")) -> PortOwner | None:
    """The process listening on ``port`` (any address), where this user can see it; None when unknown."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port, proc)}
    if not inodes:
        return None
    try:
        pids = sorted(int(p.name) for p in proc.iterdir() if p.name.isdigit())
    except OSError:
        return None
    for pid in pids:
        fd_dir = proc / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd_dir / fd) in inodes:
                    command = _cmdline(pid, proc)
                    return PortOwner(pid, command[:120], _gcs_of(pid, proc))
            except OSError:
                continue
    return None


def gpu_driver_present(root: Path = Path("/")) -> bool:
    """Whether this machine shows a GPU driver at all (NVIDIA's ``/proc/driver/nvidia/gpus`` or ``/dev/nvidia*``,
    ROCm's ``/dev/kfd``): without one no CUDA device can exist, and torch need not even be imported to say so."""
    gpus = root / "proc/driver/nvidia/gpus"
    try:
        if gpus.is_dir() and any(gpus.iterdir()):
            return True
    except OSError:
        pass
    dev = root / "dev"
    try:
        return any(p.name.startswith("nvidia") or p.name == "kfd" for p in dev.iterdir())
    except OSError:
        return True  # cannot tell: let torch say


def check_device(device: str, ranks: int) -> None:
    """``--device cuda`` needs a CUDA GPU per rank on this machine (a private Ray instance): ``ValueError``
    naming what is missing, before anything starts (without importing torch when no GPU driver is there)."""
    if device != "cuda":
        return
    if not gpu_driver_present():
        raise ValueError("--device cuda: no GPU on this machine (no NVIDIA driver: /proc/driver/nvidia/gpus and "
                         "/dev/nvidia* are absent): use --device cpu, or run where GPUs are (--address joins a GPU "
                         "cluster)")
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is a CPU build" if torch.version.cuda is None
               else "no GPU visible (no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them)")
        raise ValueError(f"--device cuda: no CUDA GPU on this machine ({why}; torch {torch.__version__}): "
                         f"use --device cpu, or run where GPUs are (--address joins a GPU cluster)")
    have = torch.cuda.device_count()
    if have < ranks:
        raise ValueError(f"--device cuda: {ranks} ranks need {ranks} GPUs (one per rank), this machine has {have}: "
                         f"pass --data-parallel-size {have} (or --ranks {have})")


def model_context(folder: str) -> int | None:
    """The model's positions (``max_position_embeddings`` of ``config.json``, or of its ``text_config``)."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("max_position_embeddings"), int):
            return int(c["max_position_embeddings"])
    return None


def check_max_model_len(max_model_len: int | None, folder: str) -> None:
    """``--max-model-len`` positive and within the model's positions (vLLM refuses a longer one too)."""
    if max_model_len is None:
        return
    if max_model_len < 2:
        raise ValueError(f"--max-model-len={max_model_len}: must be at least 2 (a prompt token and one to generate)")
    limit = model_context(folder)
    if limit is not None and max_model_len > limit:
        raise ValueError(f"--max-model-len={max_model_len} exceeds the model's {limit} positions "
                         f"(max_position_embeddings in {folder}/config.json)")


__all__ = ["PortOwner", "address_taken", "check_device", "check_max_model_len", "gpu_driver_present", "model_context",
           "port_owner"]
