"""RayFleet: the coordinator's shards behind Ray actor handles (the ``Fleet`` a ``ControlPlane`` drives).

Calls with a deadline wait with ``ray.wait(refs, timeout=...)``: a shard that does not answer in time is named
in ``RankTimeoutError`` and the coordinator goes on (its other methods keep answering meanwhile). A hung expert
copy or checkpoint load may still land after its operation was aborted: the fleet frees what it stored then
(``drop_experts`` on that rank, which keeps every weight a prepared generation uses).
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import ray
from pydantic import BaseModel

from ray_moe.control.operations import RankTimeoutError
from ray_moe.control.plane import Fleet
from ray_moe.core.errors import RankDeadError

Key = tuple[int, int]


class RayFleet(Fleet):
    """Shard actors behind Ray handles; pydantic arguments travel as JSON. With ``nccl`` set, expert copies
    go GPU to GPU over the shards' migration communicator; otherwise through the object store."""

    def __init__(self, handles: Mapping[int, Any], *, nccl: bool = False) -> None:
        self.handles = dict(handles)
        self.nccl = nccl
        self.bytes_copied = 0  # measured bytes that crossed between shards for expert copies
        self.late_freed = 0  # copies / loads that landed after their deadline and were freed

    def ranks(self) -> list[int]:
        return sorted(self.handles)

    def call(self, method: str, args: Mapping[int, tuple]) -> dict[int, Any]:
        return self.call_within(method, args, None)

    def call_within(self, method: str, args: Mapping[int, tuple], timeout_s: float | None) -> dict[int, Any]:
        refs = {r: getattr(self.handles[r], method).remote(*[_wire(a) for a in a_]) for r, a_ in args.items()}
        if timeout_s is not None and refs:
            _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=max(0.0, float(timeout_s)))
            if pending:
                late = sorted(r for r, ref in refs.items() if ref in pending)
                if method == "load_experts":
                    for r in late:
                        self._free_when_landed(refs[r], r, args[r][0])
                raise RankTimeoutError(f"{method}: rank(s) {late} did not answer within {float(timeout_s):.2f}s",
                                       ranks=tuple(late))
        out: dict[int, Any] = {}
        dead: list[int] = []
        first: BaseException | None = None
        for r, ref in refs.items():
            try:
                out[r] = ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(r)
            except BaseException as exc:  # noqa: BLE001 - re-raised after every rank answered
                first = first or exc
        if dead:
            raise RankDeadError(f"{method}: shard actor(s) of rank(s) {dead} are dead", ranks=tuple(dead))
        if first is not None:
            raise first
        return out

    def copy_experts(self, dst: int, src: int, keys: Sequence[Key]) -> dict[Key, str]:
        return self.copy_within(dst, src, keys, None)

    def copy_within(self, dst: int, src: int, keys: Sequence[Key], timeout_s: float | None) -> dict[Key, str]:
        keys = [(int(l), int(e)) for l, e in keys]
        timeout = None if timeout_s is None else max(0.0, float(timeout_s))
        try:
            if self.nccl:
                send = self.handles[src].send_experts.remote(keys, dst)
                recv = self.handles[dst].recv_experts.remote(keys, src)
                self._wait({src: send, dst: recv}, timeout, f"copy rank {src} -> rank {dst}", recv, dst, keys)
                self.bytes_copied += int(ray.get(send))
                return ray.get(recv)
            ref = self.handles[dst].fetch_experts.remote(self.handles[src], keys)
            self._wait({dst: ref}, timeout, f"copy rank {src} -> rank {dst}", ref, dst, keys)
            digests, nbytes = ray.get(ref)
            self.bytes_copied += int(nbytes)
            return digests
        except ray.exceptions.RayActorError as exc:
            raise RankDeadError(f"copy rank {src} -> rank {dst}: {exc}", ranks=(src, dst)) from None

    def _wait(self, refs: Mapping[int, Any], timeout: float | None, what: str, landing: Any, dst: int,
              keys: Sequence[Key]) -> None:
        if timeout is None:
            return
        _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        if pending:
            self._free_when_landed(landing, dst, keys)
            late = sorted(r for r, ref in refs.items() if ref in pending)
            raise RankTimeoutError(f"{what}: rank(s) {late} did not answer within {timeout:.2f}s", ranks=tuple(late))

    def _free_when_landed(self, ref: Any, rank: int, keys: Sequence[Key]) -> None:
        """When ``ref`` (a copy or load into ``rank``, past its deadline) finishes, free the weights it stored."""
        handle, keys = self.handles[rank], [tuple(k) for k in keys]

        def reap() -> None:
            ray.wait([ref], timeout=None)
            try:
                ray.get(handle.drop_experts.remote(keys))
                self.late_freed += 1
            except Exception:  # noqa: BLE001 - a dead rank holds nothing
                pass

        threading.Thread(target=reap, name=f"ray-moe-late-copy-{rank}", daemon=True).start()


def _wire(x: Any) -> Any:
    return x.model_dump_json() if isinstance(x, BaseModel) else x
