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
- ``PeerSum(group)``, called on a buffer: on a group of 2 ranks, ``buffer += the other rank's
  buffer`` in one exchange of the whole buffer: an all-reduce (sum) in one round, with the same
  result on both ranks bit for bit (``a + b == b + a``). Blocks; returns ``buffer``. Called once per
  step on buffers of one size (DDP's last gradient bucket), it posts the receive for the next call
  as soon as a call ends. Gloo sends a payload only once its receiver has posted the receive (its
  unbound buffers meet first): with the receive posted a step ahead, each rank's gradients leave
  when it arrives, and the rank that arrives last finds its peer's already there instead of waiting
  for the peer's process to be scheduled, which on a CPU under a cgroup quota can take a whole
  throttled period. Posts from the second call on (DDP settles its buckets at its second step); a
  later call on a buffer of another size or dtype raises ``RuntimeError`` on both ranks before
  anything is sent. Making one is collective: the ranks agree on a tag of its own, so an instance
  given up with a receive still posted never takes a newer one's messages (the group's
  destruction frees it). Raises ``ValueError`` on a group not of 2 ranks.

Users: ``train.sharded.pairwise`` (FSDP2's all-gather and reduce-scatter) and ``train.sync``
(DDP's last gradient bucket on 2 ranks). Why by hand: gloo has no reduce-scatter (it all-reduces
the whole buffer), and its all-gather and two-rank all-reduce go round a ring in steps, each of
which waits for both processes to be scheduled; docs/benchmarks.md has the measurements.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["PeerSum", "agreed", "exchange"]

SWITCH = "RELAY_PAIRWISE"
PEER_SUM_TAGS = 1 << 20  # PeerSum's tags start here, above what user code sends with
_next_tag = PEER_SUM_TAGS


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


class PeerSum:
    """``buffer += the peer's buffer`` each call, the next receive posted ahead (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        global _next_tag
        self.group = group or dist.group.WORLD
        if self.group.size() != 2:
            raise ValueError(f"PeerSum needs a group of 2 ranks, this one has {self.group.size()}; "
                             "use dist.all_reduce")
        agreed_tag = torch.tensor([_next_tag])
        dist.all_reduce(agreed_tag, op=dist.ReduceOp.MAX, group=self.group)
        self.tag, _next_tag = int(agreed_tag.item()), int(agreed_tag.item()) + 1
        self.peer = dist.get_global_rank(self.group, 1 - self.group.rank())
        self.calls = 0
        self._posted: tuple[torch.Tensor, dist.Work] | None = None  # the next call's receive

    def __call__(self, buffer: torch.Tensor) -> torch.Tensor:
        """Sum ``buffer`` with the peer's, in place; blocks. ``RuntimeError`` when a receive is posted
        for a buffer of another size or dtype."""
        posted, self._posted = self._posted, None
        if posted is None:
            received = torch.empty_like(buffer)
            receiving = dist.irecv(received, self.peer, group=self.group, tag=self.tag)
        else:
            received, receiving = posted
            if (received.numel(), received.dtype) != (buffer.numel(), buffer.dtype):
                raise RuntimeError(f"the summed buffer changed from {received.numel()} {received.dtype} elements to "
                                   f"{buffer.numel()} {buffer.dtype} after the receive was posted for it; "
                                   f"run with {SWITCH}=0 to sum by gloo's all-reduce")
        sending = dist.isend(buffer, self.peer, group=self.group, tag=self.tag)
        receiving.wait()
        sending.wait()
        buffer.add_(received)
        self.calls += 1
        if self.calls >= 2:
            self._posted = (received, dist.irecv(received, self.peer, group=self.group, tag=self.tag))
        return buffer
