"""The shard format: a dataset as ``shard-NNNNNN.pt`` files and an ``index.json`` written last. Pure.

A dataset folder (any store: ``s3://…``, ``hdfs://…``, a local or shared folder)::

    index.json           {"format", "kind", "fields": {name: {"dtype", "shape"}}, "samples",
                          "shards": [{"name", "samples", "bytes", "sha256"}, …]}
    shard-000000.pt      torch.save of {field: tensor[n, *shape]}: n samples as columns
    shard-000001.pt      …

A sample is a dict of tensors (``kind: "dict"``) or a tuple of them (``kind: "tuple"``, fields
``"0"``, ``"1"`` …). A shard is read with ``torch.load(weights_only=True)``: nothing in it can run
code. The index is written after every shard, so a dataset whose packing died has no index
and is refused rather than read in part.

Contract: ``ShardIndex.parse(data, where)`` raises ``InvalidSpec`` naming ``where`` and the entry
on anything malformed; ``parse_size("64MiB")`` raises ``ValueError`` naming the text.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from torchrelay.errors import InvalidSpec

FORMAT = "torchrelay-shards/1"
INDEX = "index.json"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def shard_name(number: int) -> str:
    return f"shard-{number:06d}.pt"


def parse_size(text: str | int) -> int:
    """Bytes of ``64MiB``, ``500MB``, ``1GiB``, ``4096`` (plain bytes). Raises ``ValueError``."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise ValueError(f"size {text!r} is not a size; write e.g. 64MiB, 500MB or 1048576")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    if size < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return size


@dataclasses.dataclass(frozen=True, slots=True)
class ShardEntry:
    name: str
    samples: int
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True, slots=True)
class ShardIndex:
    """What ``index.json`` says: the fields of a sample and every shard in order."""

    kind: str  # "dict" or "tuple"
    fields: dict[str, dict[str, Any]]  # name -> {"dtype": "float32", "shape": [8, 8]}
    shards: tuple[ShardEntry, ...]

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def sizes(self) -> list[int]:
        return [s.samples for s in self.shards]

    def identity(self) -> str:
        """A short name of exactly this dataset (its shards' digests): a checkpoint's position
        refers to it."""
        import hashlib

        return hashlib.sha256("".join(s.sha256 for s in self.shards).encode()).hexdigest()[:16]

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "kind": self.kind, "fields": self.fields, "samples": self.samples,
                           "shards": [dataclasses.asdict(s) for s in self.shards]}, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> "ShardIndex":
        try:
            raw = json.loads(data)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
            kind, fields = raw["kind"], raw["fields"]
            if kind not in ("dict", "tuple") or not isinstance(fields, dict) or not fields:
                raise ValueError(f"kind {kind!r} or fields {fields!r:.80}")
            shards = tuple(_entry(item) for item in raw["shards"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidSpec(f"{where} is not a shard index of {FORMAT} ({exc})") from None
        if not shards:
            raise InvalidSpec(f"{where} lists no shards")
        return cls(kind=kind, fields=fields, shards=shards)


def _entry(item: Any) -> ShardEntry:
    entry = ShardEntry(name=str(item["name"]), samples=int(item["samples"]), bytes=int(item["bytes"]),
                       sha256=str(item["sha256"]))
    if "/" in entry.name or entry.name.startswith(".") or entry.samples < 1 or entry.bytes < 1:
        raise ValueError(f"shard entry {item!r:.120}")
    return entry
