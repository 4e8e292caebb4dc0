"""FSDP2's all-gather and reduce-scatter on gloo, as one round of point-to-point exchanges.

Contract:
- ``PairwiseAllGather`` and ``PairwiseReduceScatter`` are FSDP2 custom collectives
  (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``): each rank sends every
  peer its piece and receives every peer's in one round (``batch_isend_irecv``), and blocks until
  all of them are done. Results equal gloo's collectives: the all-gather bit for bit, the
  reduce-scatter up to the order of the sum over more than two ranks.
- The reduce-scatter takes ``SUM`` and ``AVG`` (what FSDP2 asks for float32 and bfloat16
  gradients); any other op, and any ``async_op=True`` call (an explicit ``unshard(async_op=True)``),
  goes to gloo's own collective. It does not modify its input.
- ``install(module)`` sets both on every FSDP module of ``module``. ``use_pairwise(module, group,
  on_cpu)`` installs them when ``train.exchange.agreed(on_cpu, group)`` (gloo, and every rank on
  CPU with ``RELAY_PAIRWISE`` not ``0``); True when it did. Collective over ``group`` on gloo.

Why by hand: gloo has no reduce-scatter of its own; ``ProcessGroupGloo`` runs an all-reduce of the
whole buffer and keeps a slice, which moves twice the bytes a reduce-scatter needs. And its ring
all-gather measured about 1.5 times a direct exchange of the same bytes on these CPUs. Both are
bandwidth-optimal as exchanges: each rank sends (N-1)/N of the buffer, as a ring does, in one round
instead of N-1 (a unit of the char LM, 3 MiB, 2 ranks: reduce-scatter 4.5 -> 2.3 ms, all-gather
2.8 -> 1.8 ms; benchmarks.md has the step times).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchrelay.train.exchange import agreed, exchange

__all__ = ["PairwiseAllGather", "PairwiseReduceScatter", "install", "use_pairwise"]


class _PlainAlloc:
    # FSDP2 calls ``allocate`` and then the object itself; its ``AllGather`` / ``ReduceScatter`` base
    # classes are not exported by torch 2.13 (only a private module has them), so these are duck-typed.
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class PairwiseAllGather(_PlainAlloc):
    """``output[r] = rank r's input`` for every rank r of ``group`` (``output`` viewed as ``size × input``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        if async_op:
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
        size, rank = group.size(), group.rank()
        pieces = output_tensor.view(size, -1)
        exchange([(input_tensor, pieces[peer], peer) for peer in range(size) if peer != rank], group)
        if pieces[rank].data_ptr() != input_tensor.data_ptr():  # FSDP2 gathers in place: its input is this piece
            pieces[rank].copy_(input_tensor)
        return None


class PairwiseReduceScatter(_PlainAlloc):
    """``output = op over ranks r of (rank r's input)[this rank's piece]``, for ``SUM`` and ``AVG``."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        if async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
        size, rank = group.size(), group.rank()
        pieces = input_tensor.view(size, -1)
        peers = [peer for peer in range(size) if peer != rank]
        received = torch.empty((len(peers), pieces.shape[1]), dtype=input_tensor.dtype, device=input_tensor.device)
        exchange([(pieces[peer], received[i], peer) for i, peer in enumerate(peers)], group)
        torch.sum(received, dim=0, out=output_tensor)
        output_tensor.add_(pieces[rank])
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(size)
        return None


def install(module: nn.Module) -> None:
    """Set the pairwise collectives on every FSDP module of ``module``, unconditionally."""
    from torch.distributed.fsdp import FSDPModule

    all_gather, reduce_scatter = PairwiseAllGather(), PairwiseReduceScatter()
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_custom_all_gather(all_gather)
            sub.set_custom_reduce_scatter(reduce_scatter)


def use_pairwise(module: nn.Module, group: dist.ProcessGroup, on_cpu: bool) -> bool:
    """Install the pairwise collectives if every rank agrees (see the module docstring). Collective."""
    if not agreed(on_cpu, group):
        return False
    install(module)
    return True
