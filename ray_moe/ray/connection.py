"""Joining a running Ray cluster from a short-lived client (the ``ray-moe`` commands), failing in one line.

``join_cluster(address, env)``:

1. Ray already initialised in this process (tests, a notebook): nothing to do.
2. The address: ``address`` (``--address``), else ``RAY_ADDRESS``, else ``auto`` (the cluster ``ray start``
   left on this machine).
3. Nothing listening at that address's GCS port (a TCP connect, ``probe_timeout_s``):
   ``ClusterConnectionError`` saying so and how to start one, without waiting on Ray's retries.
4. ``ray.init`` with Ray's own output silenced: its Python logger at ERROR, and whatever its C++ client writes
   to stderr while connecting (one "Unauthenticated" warning per retry) captured; GCS retries capped at
   ``connect_wait_s`` seconds (Ray's default is 20).
5. A refused or missing token: ``ClusterAuthError`` telling the user to ``export RAY_AUTH_MODE=token`` and
   where the token comes from; any other failure: ``ClusterConnectionError`` with Ray's reason in one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import traceback
from typing import Iterator

from ray_moe.core.env import EnvSettings, cap_ray_connect_wait, read_env
from ray_moe.core.errors import ClusterAuthError, ClusterConnectionError, error_line

_AUTH_MARKERS = ("InvalidAuthToken", "Unauthenticated", "AuthenticationError", "authentication token")
_NO_TOKEN_MARKER = "no authentication token was found"

START_HINT = ("start one with `ray start --head` (or `ray up cluster.yaml`), or point --address / RAY_ADDRESS "
              "at a running head node (HOST:6379)")
TOKEN_SOURCES = ("Ray reads the token from RAY_AUTH_TOKEN, the file named by RAY_AUTH_TOKEN_PATH, or "
                 "~/.ray/auth_token; `ray get-auth-token` on the head node prints it")


def join_cluster(address: str | None = None, env: EnvSettings | None = None, *, namespace: str | None = None,
                 probe_timeout_s: float = 3.0, connect_wait_s: int = 2) -> None:
    """Connect this process to a running Ray cluster, or raise ``ClusterConnectionError`` / ``ClusterAuthError``
    with a one-line message (see the module docstring)."""
    import ray

    if ray.is_initialized():
        return
    env = env or read_env()
    addr = address or env.ray_address or "auto"
    cap_ray_connect_wait(connect_wait_s)
    with _captured_stderr() as captured:
        try:
            target = _resolve(addr)
            if target is not None:
                _probe(addr, target, probe_timeout_s)
            ray.init(address=addr, namespace=namespace or env.namespace, log_to_driver=False,
                     logging_level=logging.ERROR)
            return
        except ClusterConnectionError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below, in one line
            failure = exc
    text = "".join(traceback.format_exception(failure)) + captured.text
    raise _classify(addr, failure, text, env) from None


def _classify(addr: str, exc: BaseException, text: str, env: EnvSettings) -> ClusterConnectionError:
    where = "this machine's Ray cluster" if addr == "auto" else f"the Ray cluster at {addr}"
    if _NO_TOKEN_MARKER in text:
        return ClusterAuthError(f"RAY_AUTH_MODE=token but no authentication token was found: {TOKEN_SOURCES}")
    if any(m in text for m in _AUTH_MARKERS):
        if (env.ray_auth_mode or "").lower() != "token":
            return ClusterAuthError(f"{where} requires token authentication and this shell sends no token: "
                                    f"export RAY_AUTH_MODE=token ({TOKEN_SOURCES})")
        return ClusterAuthError(f"{where} refused this shell's authentication token: use the cluster's token "
                                f"({TOKEN_SOURCES})")
    if "Could not find any running Ray instance" in text:
        return ClusterConnectionError(f"no running Ray cluster found on this machine: {START_HINT}")
    if "Failed to connect to GCS" in text or "Failed to connect to Ray cluster" in text:
        at = "on this machine" if addr == "auto" else f"at {addr}"
        return ClusterConnectionError(f"no Ray cluster answers {at} (its port is open but no Ray GCS replied): "
                                      f"{START_HINT}")
    return ClusterConnectionError(f"could not connect to {where}: {error_line(exc)}")


def _resolve(addr: str) -> tuple[str, int] | None:
    """(host, port) of the GCS to probe, or None when the address is not a plain host:port (``ray://``)."""
    if "://" in addr:
        return None
    if addr == "auto":
        try:  # the lookup ray.init("auto") does itself; private, so best effort only
            from ray._private.services import canonicalize_bootstrap_address

            resolved = canonicalize_bootstrap_address("auto")
        except ConnectionError:
            raise ClusterConnectionError(f"no running Ray cluster found on this machine: {START_HINT}") from None
        except Exception:  # noqa: BLE001 - leave the lookup to ray.init
            return None
        if not resolved:
            return None
        addr = resolved
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterConnectionError(f"address={addr!r} is not HOST:PORT (e.g. 10.0.0.5:6379)")
    return host.strip("[]") or "127.0.0.1", int(port)


def _probe(addr: str, target: tuple[str, int], timeout_s: float) -> None:
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return
    except OSError as exc:
        reason = "connection refused" if isinstance(exc, ConnectionRefusedError) else \
            "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else (exc.strerror or str(exc))
        raise ClusterConnectionError(f"no Ray cluster at {addr} ({reason}): {START_HINT}") from None


class _Captured:
    text = ""


@contextlib.contextmanager
def _captured_stderr() -> Iterator[_Captured]:
    """Redirect file descriptor 2 (Ray's C++ client logs there directly) into a temporary file."""
    box = _Captured()
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable fd 2: nothing to capture
        yield box
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box.text = tmp.read().decode("utf-8", errors="replace")
