"""A deployment's durable coordinator record in Ray's GCS KV (``DurableStore``): what a restarted coordinator
rebuilds from (``control/recovery.py`` says what is in it and how the rebuild decides)."""

from __future__ import annotations

from ray_moe.control.recovery import DurableRecord

_KV_NAMESPACE = "ray-moe"


class DurableStore:
    """One deployment's durable coordinator record in Ray's GCS KV (``ray.experimental.internal_kv``).

    Keys ``<ray namespace>/<deployment>/<part>`` in KV namespace ``ray-moe``; parts: ``record`` (JSON
    ``DurableRecord``: the target too), ``handles`` (pickled: the shard actor handles and the members, each rank's
    state and bundle, the placement groups: ``Reconciler.durable``), ``releases`` (pickled release
    registry), ``load`` (JSON load window). The coordinator is the only writer; ``Runtime.start`` clears
    it for a fresh deployment and ``Runtime.shutdown`` deletes it.
    """

    PARTS = ("record", "handles", "releases", "load")

    def __init__(self, namespace: str, deployment: str) -> None:
        self.prefix = f"{namespace}/{deployment}/"

    def _key(self, part: str) -> bytes:
        return (self.prefix + part).encode()

    def put(self, part: str, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self._key(part), value, overwrite=True, namespace=_KV_NAMESPACE)

    def get(self, part: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(self._key(part), namespace=_KV_NAMESPACE)

    def clear(self) -> None:
        from ray.experimental import internal_kv

        for part in self.PARTS:
            internal_kv._internal_kv_del(self._key(part), namespace=_KV_NAMESPACE)

    def record(self) -> DurableRecord | None:
        raw = self.get("record")
        return None if raw is None else DurableRecord.model_validate_json(raw)


__all__ = ["DurableStore"]
