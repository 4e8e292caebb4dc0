"""The device mesh of a sharded job and what each rank holds. Pure: numbers in, values out.

- ``MeshShape`` — sizes of the mesh's dimensions: ``pp`` (pipeline stages), ``dp`` (FSDP
  shards: a stage's replicas), ``tp`` (tensor-parallel group). Rank ``r`` sits at
  ``dp = r // (pp·tp)``, ``pp = (r // tp) % pp``, ``tp = r % tp``: a tensor-parallel group is
  consecutive ranks (the fastest link on one host), and the stages of one replica are
  consecutive too, as the pipeline lays them out (rank = replica × stages + stage).
  ``mesh_shape(world, tensor_parallel=…, stages=…)`` refuses a world the degrees do not divide
  (``InvalidSpec`` naming both).
- ``Holding`` — one rank's share: its coordinates, the blocks (pipeline) and the fraction of each
  unit's parameters, gradients and optimizer state it keeps, and the bytes. ``describe_layout``
  renders the shape and every rank's holding as text for ``relay status``; ``layout_dict`` is
  the JSON artifact (``sharded-layout.json``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torchrelay.errors import InvalidSpec
from torchrelay.spec import format_memory

__all__ = ["Holding", "MeshShape", "describe_layout", "layout_dict", "mesh_shape"]


@dataclass(kw_only=True, slots=True, frozen=True)
class MeshShape:
    """``pp × dp × tp`` ranks (see the module docstring)."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """The dimensions with more than one rank, outermost first (at least ``dp``)."""
        named = (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
        kept = tuple((n, s) for n, s in named if s > 1)
        return kept or (("dp", 1),)

    def coordinates(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size}")
        return {"pp": (rank // self.tp) % self.pp, "dp": rank // (self.pp * self.tp), "tp": rank % self.tp}

    def text(self) -> str:
        return " × ".join(f"{name} {size}" for name, size in self.dims)


def mesh_shape(world_size: int, *, tensor_parallel: int = 1, stages: int = 1) -> MeshShape:
    """The mesh of ``world_size`` ranks with these degrees. Raises ``InvalidSpec`` when they do not divide it."""
    for name, value in (("tensor_parallel", tensor_parallel), ("stages", stages), ("workers", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidSpec(f"{name}={value!r} must be an integer >= 1")
    if world_size % (tensor_parallel * stages):
        raise InvalidSpec(f"workers={world_size} is not a multiple of stages × tensor_parallel = "
                          f"{stages} × {tensor_parallel}; use workers = {stages * tensor_parallel} × k")
    return MeshShape(pp=stages, dp=world_size // (tensor_parallel * stages), tp=tensor_parallel)


@dataclass(kw_only=True, slots=True, frozen=True)
class Holding:
    """What one rank keeps: its place, its blocks, and bytes of its shares (this rank's, measured)."""

    rank: int
    coordinates: dict[str, int]
    blocks: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    parameter_bytes: int = 0
    full_parameter_bytes: int = 0
    tensor_parallel_modules: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def fraction(self) -> float:
        return self.parameter_bytes / self.full_parameter_bytes if self.full_parameter_bytes else 0.0


def describe_layout(shape: MeshShape, holdings: list[Holding]) -> str:
    """Text: the mesh, then one line per rank (coordinates, share, blocks), then the notes once."""
    lines = [f"mesh {shape.text()} ({shape.world_size} ranks): pipeline stages × FSDP shards × tensor parallel"]
    for h in sorted(holdings, key=lambda h: h.rank):
        where = " ".join(f"{n}={h.coordinates[n]}" for n, _ in shape.dims)
        blocks = f" blocks {', '.join(h.blocks)}" if h.blocks else ""
        lines.append(f"  rank {h.rank} [{where}]: {format_memory(h.parameter_bytes)} of "
                     f"{format_memory(h.full_parameter_bytes)} parameters ({h.fraction:.0%}), "
                     f"{len(h.units)} FSDP units{blocks}")
    tp = next((h.tensor_parallel_modules for h in holdings if h.tensor_parallel_modules), ())
    if tp:
        lines.append(f"  tensor parallel: {', '.join(tp)}")
    notes = sorted({n for h in holdings for n in h.notes})
    lines.extend(f"  note: {n}" for n in notes)
    return "\n".join(lines)


def layout_dict(shape: MeshShape, holdings: list[Holding]) -> dict[str, Any]:
    """The JSON form: ``{"mesh": {...}, "ranks": [...], "text": ...}``."""
    return {"mesh": {"pp": shape.pp, "dp": shape.dp, "tp": shape.tp, "world_size": shape.world_size},
            "ranks": [{**asdict(h), "fraction": h.fraction} for h in sorted(holdings, key=lambda h: h.rank)],
            "text": describe_layout(shape, holdings)}
