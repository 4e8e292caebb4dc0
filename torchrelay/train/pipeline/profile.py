"""Measure what each pipeline block costs on the device it will run on.

Contract:
- ``profile_blocks(blocks, sample, device, ...)`` returns one ``BlockCost`` per block for one
  micro-batch ``sample``: median forward+backward seconds, the bytes of the activation it
  outputs, the bytes autograd keeps for its backward (counted through saved-tensor hooks,
  parameters excluded) and parameter+gradient+optimizer-state bytes (the optimizer is built
  with ``optimizer_factory`` and stepped once, so its state is measured, not assumed).
- Blocks may live on the meta device: each is copied, materialised on ``device`` alone,
  measured and freed, so profiling never holds more than one block. Blocks already on a real
  device are measured in place and their gradients are cleared afterwards.
- If ``loss_fn`` and ``sample_target`` are given, the last block's time includes the loss.
- ``measure_link(rank_a, rank_b)`` times point-to-point transfers between two ranks of the
  current process group (both ranks must call it; others may too and return at once).
- Timings use ``compute_clock(device)``: on a CPU computing in one thread it is that thread's
  CPU time, which other processes sharing the cores distort far less than wall-clock time;
  otherwise wall-clock time (CUDA synchronised). The runtime times its compute with the same
  clock, so predictions and measurements compare like with like.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchrelay.train.pipeline.partition import BlockCost, Link
from torchrelay.train.pipeline.meta import materialize_module


def compute_clock(device: torch.device | str) -> Callable[[], float]:
    """Seconds counter for compute on ``device`` (see the module docstring)."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return _bytes(obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _fwd_bwd(block: nn.Module, x: torch.Tensor, grad_fn: Callable[[torch.Tensor], torch.Tensor]
             ) -> torch.Tensor:
    inp = x.detach().requires_grad_(x.is_floating_point())
    out = block(inp)
    loss_or_out = grad_fn(out)
    if loss_or_out.dim() == 0:
        loss_or_out.backward()
    else:
        loss_or_out.backward(torch.ones_like(loss_or_out))
    return out


def _stash_bytes(block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    param_ptrs = {p.data_ptr() for p in block.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
        if t.data_ptr() not in param_ptrs and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    inp = x.detach().requires_grad_(x.is_floating_point())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(inp)
    return out, total


def profile_blocks(blocks: Sequence[nn.Module], sample: torch.Tensor,
                   device: torch.device | str = "cpu", *,
                   optimizer_factory: Callable | None = None,
                   loss_fn: Callable | None = None, sample_target: torch.Tensor | None = None,
                   warmup: int = 2, repeats: int = 5, seed: int = 0) -> list[BlockCost]:
    """One ``BlockCost`` per block, measured on ``device`` with one micro-batch ``sample``.

    Blocks. Raises ``ValueError`` naming the block whose output is not a single tensor.
    """
    device = torch.device(device)
    x = sample.to(device)
    target = sample_target.to(device) if sample_target is not None else None
    clock = compute_clock(device)
    costs = []
    for index, original in enumerate(blocks):
        on_meta = any(t.device.type == "meta" for t in
                      [*original.parameters(), *original.buffers()])
        block = materialize_module(copy.deepcopy(original), device, seed=seed + index) \
            if on_meta else original
        is_last = index == len(blocks) - 1
        if is_last and loss_fn is not None and target is not None:
            def grad_fn(out, _target=target):
                return loss_fn(out, _target)
        else:
            def grad_fn(out):
                return out
        out, stash = _stash_bytes(block, x)
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"pipeline block {index} ({type(original).__name__}) returned "
                             f"{type(out).__name__}; every block must map one tensor to one tensor")
        times = []
        for rep in range(warmup + repeats):
            _sync(device)
            started = clock()
            _fwd_bwd(block, x, grad_fn)
            _sync(device)
            if rep >= warmup:
                times.append(clock() - started)
        params = [p for p in block.parameters() if p.requires_grad]
        param_bytes = 2 * sum(_bytes(p) for p in params)  # weights and their gradients
        if optimizer_factory is not None and params:
            optimizer = optimizer_factory(params)
            optimizer.step()
            param_bytes += sum(_tensor_bytes(s) for s in optimizer.state.values())
            del optimizer
        block.zero_grad(set_to_none=True)
        costs.append(BlockCost(time_s=statistics.median(times), out_bytes=_bytes(out),
                               param_bytes=param_bytes, stash_bytes=stash,
                               name=f"{index}:{type(original).__name__}"))
        x = out.detach()
        del block
    return costs


def measure_link(rank_a: int, rank_b: int, num_bytes: int = 4 << 20, repeats: int = 10,
                 device: torch.device | str = "cpu", group=None) -> Link:
    """Bandwidth and latency between two ranks, by timed round trips. Collective for the pair.

    The fastest round trip counts, not the median: on shared cores a round trip also waits
    for the peer process to be scheduled, which is not the link's cost (and the runtime's
    posted-ahead receives hide it)."""
    rank = dist.get_rank(group)
    if rank not in (rank_a, rank_b):
        return Link()
    peer = rank_b if rank == rank_a else rank_a
    device = torch.device(device)

    def round_trips(size: int) -> float:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats + 1):
            _sync(device)
            started = time.perf_counter()
            if rank == rank_a:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            _sync(device)
            times.append((time.perf_counter() - started) / 2)
        return min(times[1:])

    small = round_trips(4)
    large = round_trips(num_bytes)
    bandwidth = num_bytes / max(large - small, 1e-9)
    return Link(bandwidth_bytes_per_s=bandwidth, latency_s=small)
