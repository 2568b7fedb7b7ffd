"""The release bundle: one compatibility object (spec 0x0C, 0x0CA). Pure: no Ray.

A release is the tuple ``R = (C, P, T, G, A, D, B, Q)`` plus the digests of the upstream evidence
reports: checkpoint identity, placement generation, topology, process-group generation, route and handle
ABIs, dtype roles, phase/backend selection and graph manifests. A change to any coordinate needs a new
release identity, so:

* ``bundle_digest`` is the SHA-256 of the canonical JSON (sorted keys, no whitespace) of every
  coordinate (everything except ``name``, ``release_id`` and ``bundle_digest`` itself);
* ``release_id = f"{name}@{bundle_digest[:12]}"``: the human name plus a digest prefix, so two bundles
  that differ in any coordinate have different release ids even under one human name;
* ``verify()`` recomputes both and, given the upstream reports, recomputes their digests: any drift
  is "reject build" (0x0E, first fault).

Construction validates the derived fields, so a bundle parsed from JSON with an edited coordinate is
rejected at parse time; ``verify()`` also catches in-memory drift (the ``dict`` fields are mutable
containers inside a frozen model).
"""

from __future__ import annotations

import hashlib
import json
import re
from enum import Enum
from typing import Any, Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_moe.placement.manifest import PlacementManifest

DIGEST_PREFIX_CHARS = 12
RELEASE_ID_SEPARATOR = "@"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class PhasePath(str, Enum):
    """The phase paths a release selects backends for (0x0CA)."""

    VARIABLE_PREFILL = "variable-prefill"
    FIXED_BUCKET_DECODE = "fixed-bucket-decode"
    OVERSIZE_DECODE = "oversize-decode"


class PrecisionRole(str, Enum):
    """Tensor roles whose dtype a release fixes (0x0AE)."""

    DISPATCH = "dispatch"
    COMBINE = "combine"
    GATE = "gate"
    ACCUMULATION = "accumulation"
    ROUTER = "router"


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, UTF-8 text: the only serialization that is hashed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(text: str | bytes) -> str:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def report_digest(report: bytes | str | Mapping[str, Any]) -> str:
    """Digest of one upstream report: raw bytes/text as given, a mapping through ``canonical_json``."""
    if isinstance(report, (bytes, str)):
        return sha256_hex(report)
    if isinstance(report, Mapping):
        return sha256_hex(canonical_json(dict(report)))
    raise ValueError(f"report={type(report).__name__} must be bytes, str or a JSON mapping")


class BackendManifest(BaseModel):
    """Backend selection of one phase path: dispatcher, expert runner, graph state (0x0CA table)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dispatcher: str = Field(min_length=1)
    runner: str = Field(min_length=1)
    graph_state: str = Field(min_length=1)


_COORDINATE_FIELDS = (
    "checkpoint_version",
    "checkpoint_digest",
    "placement_generation",
    "placement_digest",
    "topology_version",
    "process_group_generation",
    "route_abi",
    "dispatch_handle_abi",
    "precision_roles",
    "phase_backends",
    "graph_manifest_digest",
    "upstream_report_digests",
)
_DIGEST_FIELDS = ("checkpoint_digest", "placement_digest", "graph_manifest_digest")


def _coordinates_json(values: Mapping[str, Any]) -> str:
    body: dict[str, Any] = {}
    for f in _COORDINATE_FIELDS:
        v = values[f]
        if f == "phase_backends":
            v = {k: (b.model_dump(mode="json") if isinstance(b, BackendManifest) else dict(b)) for k, b in v.items()}
        elif f == "precision_roles":
            v = dict(v)
        elif f == "upstream_report_digests":
            v = list(v)
        body[f] = v
    return canonical_json(body)


class ReleaseBundle(BaseModel):
    """``MoEReleaseBundle`` of 0x0CA with its derived identity (``name``, ``bundle_digest``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str
    name: str
    bundle_digest: str
    checkpoint_version: str = Field(min_length=1)
    checkpoint_digest: str
    placement_generation: str = Field(min_length=1)
    placement_digest: str
    topology_version: str = Field(min_length=1)
    process_group_generation: str = Field(min_length=1)
    route_abi: str = Field(min_length=1)
    dispatch_handle_abi: str = Field(min_length=1)
    precision_roles: dict[str, str]
    phase_backends: dict[str, BackendManifest]
    graph_manifest_digest: str
    upstream_report_digests: tuple[str, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _identity(self) -> "ReleaseBundle":
        if not _NAME.match(self.name):
            raise ValueError(f"name={self.name!r} must match {_NAME.pattern} (no {RELEASE_ID_SEPARATOR!r})")
        for f in _DIGEST_FIELDS:
            if not _HEX64.match(getattr(self, f)):
                raise ValueError(f"{f}={getattr(self, f)!r} must be 64 lowercase hex characters (SHA-256)")
        for i, d in enumerate(self.upstream_report_digests):
            if not _HEX64.match(d):
                raise ValueError(f"upstream_report_digests[{i}]={d!r} must be 64 lowercase hex characters")
        if not self.precision_roles:
            raise ValueError("precision_roles={} must name at least one role")
        for role, dtype in self.precision_roles.items():
            if role not in {r.value for r in PrecisionRole}:
                raise ValueError(f"precision_roles[{role!r}] is not a role ({[r.value for r in PrecisionRole]})")
            if not isinstance(dtype, str) or not dtype:
                raise ValueError(f"precision_roles[{role!r}]={dtype!r} must be a dtype name")
        if not self.phase_backends:
            raise ValueError("phase_backends={} must select at least one phase path")
        for path in self.phase_backends:
            if path not in {p.value for p in PhasePath}:
                raise ValueError(f"phase_backends[{path!r}] is not a phase path ({[p.value for p in PhasePath]})")
        digest = self.compute_digest()
        if self.bundle_digest != digest:
            raise ValueError(f"bundle_digest={self.bundle_digest!r} does not match the coordinates ({digest!r})")
        expected_id = derive_release_id(self.name, digest)
        if self.release_id != expected_id:
            raise ValueError(f"release_id={self.release_id!r} is not derived from name and digest ({expected_id!r})")
        return self

    # --------------------------------------------------------------------------------- identity
    def coordinates(self) -> dict[str, Any]:
        """The hashed coordinates as JSON-ready data."""
        return json.loads(self.canonical_json())

    def canonical_json(self) -> str:
        return _coordinates_json({f: getattr(self, f) for f in _COORDINATE_FIELDS})

    def compute_digest(self) -> str:
        return sha256_hex(self.canonical_json())

    def verify(self, upstream_reports: Sequence[bytes | str | Mapping[str, Any]] | None = None) -> "BundleCheck":
        """Recompute the identity and (when given) the upstream report digests; list every drift.

        1. ``bundle_digest`` against the digest of the current coordinates.
        2. ``release_id`` against ``name@digest[:12]`` of the current coordinates.
        3. Each upstream report's digest against ``upstream_report_digests`` (same count, same order).
        """
        failures: list[str] = []
        digest = self.compute_digest()
        if digest != self.bundle_digest:
            failures.append(f"bundle_digest={self.bundle_digest} but coordinates hash to {digest}: hash drift")
        expected_id = derive_release_id(self.name, digest)
        if expected_id != self.release_id:
            failures.append(f"release_id={self.release_id} but coordinates give {expected_id}")
        if upstream_reports is not None:
            now = tuple(report_digest(r) for r in upstream_reports)
            if len(now) != len(self.upstream_report_digests):
                failures.append(
                    f"upstream reports: {len(now)} given, bundle binds {len(self.upstream_report_digests)}"
                )
            for i, (want, got) in enumerate(zip(self.upstream_report_digests, now)):
                if want != got:
                    failures.append(f"upstream_report_digests[{i}]={want} but the report now hashes to {got}")
        return BundleCheck(release_id=self.release_id, failures=tuple(failures))

    def require_verified(self, upstream_reports: Sequence[bytes | str | Mapping[str, Any]] | None = None) -> None:
        """``verify`` and raise ``ValueError`` listing every drift (reject build)."""
        check = self.verify(upstream_reports)
        if not check.ok:
            raise ValueError(f"release {self.release_id}: reject build: " + "; ".join(check.failures))

    def manifest_failures(self, manifest: PlacementManifest) -> tuple[str, ...]:
        """Cross-check against the placement manifest it binds (ManifestOK of 0x0DC); empty means OK."""
        out: list[str] = []
        if manifest.placement_version != self.placement_generation:
            out.append(f"placement_generation={self.placement_generation} but manifest is {manifest.placement_version}")
        if manifest.checkpoint_version != self.checkpoint_version:
            out.append(f"checkpoint_version={self.checkpoint_version} but manifest has {manifest.checkpoint_version}")
        if manifest.topology_version != self.topology_version:
            out.append(f"topology_version={self.topology_version} but manifest has {manifest.topology_version}")
        digest = manifest.content_digest()
        if digest != self.placement_digest:
            out.append(f"placement_digest={self.placement_digest} but manifest content hashes to {digest}")
        return tuple(out)


class BundleCheck(BaseModel):
    """Result of ``ReleaseBundle.verify`` (HashOK of 0x0DC is ``ok``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str
    failures: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures


def derive_release_id(name: str, digest: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name={name!r} must match {_NAME.pattern}")
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise ValueError(f"digest={digest!r} must be 64 lowercase hex characters")
    return f"{name}{RELEASE_ID_SEPARATOR}{digest[:DIGEST_PREFIX_CHARS]}"


def build_release(
    name: str,
    *,
    checkpoint_version: str,
    checkpoint_digest: str,
    placement_generation: str,
    placement_digest: str,
    topology_version: str,
    process_group_generation: str,
    route_abi: str,
    dispatch_handle_abi: str,
    precision_roles: Mapping[str, str],
    phase_backends: Mapping[str, BackendManifest | Mapping[str, str]],
    graph_manifest_digest: str,
    upstream_reports: Iterable[bytes | str | Mapping[str, Any]] | None = None,
    upstream_report_digests: Iterable[str] | None = None,
) -> ReleaseBundle:
    """Build a bundle: hash the upstream reports, hash the coordinates, derive the release id.

    1. Upstream digests come from the reports themselves (preferred) or are given; not both.
    2. Normalise enums to their values; canonicalise the coordinates and hash them.
    3. ``release_id = name@digest[:12]``; construction re-validates everything.
    """
    if (upstream_reports is None) == (upstream_report_digests is None):
        raise ValueError("upstream_reports / upstream_report_digests: give exactly one of them")
    if isinstance(upstream_report_digests, str):
        raise ValueError(f"upstream_report_digests={upstream_report_digests!r} must be a sequence of digests")
    digests = (
        tuple(report_digest(r) for r in upstream_reports)
        if upstream_reports is not None
        else tuple(upstream_report_digests)  # type: ignore[arg-type]
    )
    roles = {(k.value if isinstance(k, Enum) else k): v for k, v in precision_roles.items()}
    backends = {
        (k.value if isinstance(k, Enum) else k): (v if isinstance(v, BackendManifest) else BackendManifest(**v))
        for k, v in phase_backends.items()
    }
    coords = dict(
        checkpoint_version=checkpoint_version,
        checkpoint_digest=checkpoint_digest,
        placement_generation=placement_generation,
        placement_digest=placement_digest,
        topology_version=topology_version,
        process_group_generation=process_group_generation,
        route_abi=route_abi,
        dispatch_handle_abi=dispatch_handle_abi,
        precision_roles=roles,
        phase_backends=backends,
        graph_manifest_digest=graph_manifest_digest,
        upstream_report_digests=digests,
    )
    digest = sha256_hex(_coordinates_json(coords))
    return ReleaseBundle(
        release_id=derive_release_id(name, digest), name=name, bundle_digest=digest, **coords
    )
