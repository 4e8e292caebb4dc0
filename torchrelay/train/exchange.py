"""Collectives as one round of point-to-point exchanges, for gloo, whose own take longer on CPU.

Contract:
- ``agreed(on_cpu, group)``: whether every rank of ``group`` uses the exchanges: the backend is
  gloo and, on every rank, the tensors are on the CPU (``on_cpu``) and ``RELAY_PAIRWISE`` is not
  ``0``. Every rank must take the same path, or one would wait in an exchange while its peer
  waits in gloo's collective: a job of CPU and GPU workers on gloo keeps gloo's collectives.
  Collective on a gloo group (one all-reduce of a flag; call it where all ranks do, once, at
  prepare time); False at once on another backend.
- ``exchange(pairs, group)``: for each ``(send, recv, peer)`` sends ``send`` to the group rank
  ``peer`` and receives ``recv`` from it, all of them at once (``batch_isend_irecv``); blocks
  until every one is done.
- ``sum_with_peer_(buffer, group)``: on a group of 2 ranks, ``buffer += the other rank's buffer``
  in one exchange of the whole buffer: an all-reduce (sum) in one round, with the same result on
  both ranks bit for bit (``a + b == b + a``). Blocks; returns ``buffer``. Raises ``ValueError`` on
  a group of another size.

Users: ``train.sharded.pairwise`` (FSDP2's all-gather and reduce-scatter) and ``train.sync``
(DDP's last gradient bucket on 2 ranks). Why by hand: gloo has no reduce-scatter (it all-reduces
the whole buffer), and its all-gather and two-rank all-reduce go round a ring in steps, each of
which waits for both processes to be scheduled; docs/benchmarks.md has the measurements.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["agreed", "exchange", "sum_with_peer_"]

SWITCH = "RELAY_PAIRWISE"


def agreed(on_cpu: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether every rank of ``group`` (default: the world) uses the exchanges (see the module docstring)."""
    if dist.get_backend(group) != "gloo":
        return False
    willing = torch.tensor([int(on_cpu and os.environ.get(SWITCH, "1") != "0")])
    dist.all_reduce(willing, op=dist.ReduceOp.MIN, group=group)
    return bool(willing.item())


def exchange(pairs: list[tuple[torch.Tensor, torch.Tensor, int]], group: dist.ProcessGroup | None = None) -> None:
    """Send and receive every pair's tensors at once (see the module docstring); blocks."""
    group = group or dist.group.WORLD
    ops = []
    for send, recv, peer in pairs:
        global_peer = dist.get_global_rank(group, peer)
        ops.append(dist.P2POp(dist.isend, send, global_peer, group))
        ops.append(dist.P2POp(dist.irecv, recv, global_peer, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def sum_with_peer_(buffer: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``buffer += the other rank's buffer`` on a 2-rank group, in place; blocks. ``ValueError`` otherwise."""
    group = group or dist.group.WORLD
    if group.size() != 2:
        raise ValueError(f"sum_with_peer_ needs a group of 2 ranks, this one has {group.size()}; "
                         "use dist.all_reduce")
    received = torch.empty_like(buffer)
    exchange([(buffer, received, 1 - group.rank())], group)
    return buffer.add_(received)
