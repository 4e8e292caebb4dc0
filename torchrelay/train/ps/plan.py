"""Where every parameter byte lives: one flat buffer, cut into byte-balanced shards.

Contract (pure: no I/O, no torch state; tested with tables of cases):
- ``make_plan(layout, servers)`` lays the parameters out one after another in a single flat
  byte buffer (each parameter starting on a ``PARAM_ALIGN`` boundary) and cuts that buffer
  into ``servers`` contiguous byte ranges whose sizes differ by at most ``CUT_ALIGN`` bytes.
  A large tensor is split across servers whenever a cut falls inside it. Cuts are multiples
  of ``CUT_ALIGN`` from a parameter's start, so they always fall on an element boundary.
- ``Plan.shard(i)`` lists the typed pieces (``Segment``) of parameters inside shard ``i``:
  what the server builds its typed views and optimizer over.
- ``Plan.plan_id`` is a 63-bit hash of the whole layout; every wire message carries it, so
  a worker whose model differs from the one the servers hold is refused.
- ``Plan.to_json`` / ``Plan.from_json`` round-trip exactly (workers publish the plan; the
  servers read it from the job's store).
Raises ``ValueError`` naming the bad value for an empty layout, an unknown dtype, servers < 1.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math

PARAM_ALIGN = 64   # each parameter starts on a cache line: fast memcpy, valid typed views
CUT_ALIGN = 16     # shard cuts: a multiple of every itemsize we accept (complex128 = 16)

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclasses.dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter as the plan sees it: name, dtype name (``"float32"``), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """The part of parameter ``param`` that lies in one shard.

    ``offset`` is the byte offset inside the shard, ``start`` the first element of the
    parameter (flattened) it covers, ``numel`` how many elements.
    """

    param: int
    dtype: str
    offset: int
    start: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPlan:
    """Shard ``index``: bytes ``[begin, end)`` of the flat buffer and the typed pieces in it."""

    index: int
    begin: int
    end: int
    segments: tuple[Segment, ...]
    plan_id: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    params: tuple[ParamSpec, ...]
    offsets: tuple[int, ...]          # byte offset of each parameter in the flat buffer
    cuts: tuple[int, ...]             # servers + 1 cut points: shard i is [cuts[i], cuts[i+1])
    total_nbytes: int

    @property
    def servers(self) -> int:
        return len(self.cuts) - 1

    @property
    def plan_id(self) -> int:
        digest = hashlib.sha256(self.to_json().encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2**63 - 1)

    def shard(self, index: int) -> ShardPlan:
        if not 0 <= index < self.servers:
            raise ValueError(f"shard index {index} is out of range; the plan has {self.servers} shards")
        begin, end = self.cuts[index], self.cuts[index + 1]
        segments = []
        for i, (spec, poff) in enumerate(zip(self.params, self.offsets)):
            lo, hi = max(begin, poff), min(end, poff + spec.nbytes)
            if lo >= hi:
                continue
            size = ITEMSIZE[spec.dtype]
            segments.append(Segment(param=i, dtype=spec.dtype, offset=lo - begin,
                                    start=(lo - poff) // size, numel=(hi - lo) // size))
        return ShardPlan(index, begin, end, tuple(segments), self.plan_id)

    def to_json(self) -> str:
        return json.dumps({"params": [[p.name, p.dtype, list(p.shape)] for p in self.params],
                           "offsets": list(self.offsets), "cuts": list(self.cuts),
                           "total_nbytes": self.total_nbytes}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        data = json.loads(text)
        return cls(params=tuple(ParamSpec(n, d, tuple(s)) for n, d, s in data["params"]),
                   offsets=tuple(data["offsets"]), cuts=tuple(data["cuts"]),
                   total_nbytes=data["total_nbytes"])


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def make_plan(layout: list[ParamSpec] | tuple[ParamSpec, ...], servers: int) -> Plan:
    """Lay ``layout`` out flat and cut it into ``servers`` byte-balanced shards.

    Raises ``ValueError`` for an empty layout, an unknown dtype or ``servers < 1``.
    """
    if servers < 1:
        raise ValueError(f"servers={servers} must be at least 1")
    if not layout:
        raise ValueError("the model has no parameters to put on parameter servers")
    offsets, cursor = [], 0
    for spec in layout:
        if spec.dtype not in ITEMSIZE:
            raise ValueError(f"parameter {spec.name!r} has dtype {spec.dtype!r}; "
                             f"supported: {', '.join(ITEMSIZE)}")
        cursor = _round_up(cursor, PARAM_ALIGN)
        offsets.append(cursor)
        cursor += spec.nbytes
    total = _round_up(cursor, CUT_ALIGN)
    # Equal shares, each cut rounded to CUT_ALIGN: sizes differ by at most CUT_ALIGN bytes.
    cuts = [min(total, _round_up(total * i // servers, CUT_ALIGN)) for i in range(servers)] + [total]
    return Plan(params=tuple(layout), offsets=tuple(offsets), cuts=tuple(cuts), total_nbytes=total)
