"""Values that differ between ranks, kept once per rank in a checkpoint. Pure: no I/O, no collectives.

DCP takes a tensor that every rank holds under the same key for a replicated one and writes
a single copy. That is right for ddp, whose replicas are equal after every step, and wrong for
local SGD, DiLoCo and final averaging, whose replicas train apart between sync points: each
keeps its own parameters, buffers and inner optimizer state. ``split_replicas`` moves the
tensors that differ out of the state into an entry that only this rank has (DCP gives such a
key to its one owner). A moved value leaves its dict; in a list it leaves ``None`` behind::

    {"model": {…what is shared…}, "optimizer": {"inner": {"param_groups": …}, "sync": {…}}, "step": 6, …,
     "_torchrelay_replicas": {"world_size": 2,                       # the same on every rank: one copy
                              "rank-1": {"paths": [["model", "0.weight"], …],   # only rank 1 has it
                                         "values": {"0": tensor, …}}}}

Everything else (step counters, DiLoCo's global parameters and outer momentum, the data
position) is still written once. ``join_replicas`` puts this rank's tensors back where they were.

Contract:
- ``split_replicas(state, is_replica, rank, world_size)`` returns a new state; dicts and lists
  are rebuilt, tensors are moved by reference (never copied). Descends into dicts and lists,
  as DCP does. The input is not changed. With no tensor selected it returns the state as it was.
- ``join_replicas(state, rank, world_size, where)`` undoes it in place for this rank and returns
  the state, making again the dicts that lost every value (DCP keeps no empty dict). Raises
  ``InvalidSpec`` when the checkpoint was split over another number of ranks (every rank
  raises the same, so none waits for the others) and ``CheckpointCorrupt`` when this rank's
  entry is missing or does not fit the state.
- ``belongs_to_other_rank(path, rank)``: which flattened DCP paths a loading rank skips.
- ``same_memory(tensors)`` gives the predicate ``save_checkpoint`` uses: true for a tensor that
  views the same memory, shape and strides as one of ``tensors`` (a ``state_dict()`` holds
  detached views of the live parameters, not the parameter objects).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from torchrelay.errors import CheckpointCorrupt, InvalidSpec

REPLICAS = "_torchrelay_replicas"
WORLD_SIZE = "world_size"


def rank_key(rank: int) -> str:
    """The entry name of ``rank``'s own values (as TrainState names its RNG states)."""
    return f"rank-{rank}"


def _memory_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))


def same_memory(tensors: Iterable[torch.Tensor]) -> Callable[[torch.Tensor], bool]:
    """Predicate: ``t`` views the memory of one of ``tensors`` (empty tensors never match)."""
    keys = {_memory_key(t) for t in tensors if t.numel()}
    return lambda t: t.numel() > 0 and _memory_key(t) in keys


def split_replicas(state: dict, is_replica: Callable[[torch.Tensor], bool], rank: int,
                   world_size: int) -> dict:
    """``state`` with the tensors ``is_replica`` selects moved into this rank's own entry (module doc)."""
    if REPLICAS in state:
        raise ValueError(f"checkpoint key {REPLICAS!r} is reserved by torchrelay")
    paths: list[list[Any]] = []
    values: dict[str, torch.Tensor] = {}

    def moved(node: Any, path: tuple) -> bool:
        if isinstance(node, torch.Tensor) and is_replica(node):
            values[str(len(paths))] = node
            paths.append(list(path))
            return True
        return False

    def walk(node: Any, path: tuple) -> Any:
        # a key left in place costs more than its placeholder would say: DCP torch.saves each
        # non-tensor value (1.2 kB for a None), so moved values leave dicts instead
        if isinstance(node, dict):
            return {key: walk(value, path + (key,)) for key, value in node.items() if not moved(value, path + (key,))}
        if isinstance(node, list):
            return [None if moved(value, path + (index,)) else walk(value, path + (index,))
                    for index, value in enumerate(node)]
        return node

    out = walk(state, ())
    if not paths:
        return state
    out[REPLICAS] = {WORLD_SIZE: world_size, rank_key(rank): {"paths": paths, "values": values}}
    return out


def join_replicas(state: dict, rank: int, world_size: int, where: str = "the checkpoint") -> dict:
    """Put this rank's values back (see module doc); a state without replicas is returned as it is."""
    replicas = state.pop(REPLICAS, None)
    if replicas is None:
        return state
    saved_world = replicas.get(WORLD_SIZE) if isinstance(replicas, dict) else None
    if not isinstance(saved_world, int):
        raise CheckpointCorrupt(f"{where}: {REPLICAS!r} has no world size")
    if saved_world != world_size:
        raise InvalidSpec(
            f"{where} holds the diverged replicas of {saved_world} ranks (each rank's own parameters, "
            f"buffers and optimizer state, as local SGD, DiLoCo and final averaging keep them), but "
            f"this job runs {world_size}: resume it with {saved_world} workers")
    entry = replicas.get(rank_key(rank))
    paths, values = (entry.get("paths"), entry.get("values")) if isinstance(entry, dict) else (None, None)
    if not isinstance(paths, list) or not isinstance(values, dict) or len(paths) != len(values):
        raise CheckpointCorrupt(f"{where}: the replica entry of {rank_key(rank)} is missing or malformed")
    for index, path in enumerate(paths):
        value = values.get(str(index))
        if not isinstance(value, torch.Tensor) or not isinstance(path, list) or not path:
            raise CheckpointCorrupt(f"{where}: replica value {index} of {rank_key(rank)} is malformed")
        parent = state
        try:
            for part in path[:-1]:
                parent = parent.setdefault(part, {}) if isinstance(parent, dict) else parent[part]
            if isinstance(parent, dict):
                if parent.setdefault(path[-1], value) is not value:
                    raise KeyError(path[-1])  # the place is taken
            elif parent[path[-1]] is None:
                parent[path[-1]] = value
            else:
                raise KeyError(path[-1])
        except (KeyError, IndexError, TypeError, AttributeError):
            raise CheckpointCorrupt(f"{where}: replica value {'.'.join(map(str, path))} of {rank_key(rank)} "
                                    "has no place in the saved state") from None
    return state


def belongs_to_other_rank(path: tuple, rank: int) -> bool:
    """True for a flattened DCP path inside another rank's replica entry (this rank need not read it)."""
    return len(path) >= 2 and path[0] == REPLICAS and path[1] != WORLD_SIZE and path[1] != rank_key(rank)
