"""Measure what each pipeline block costs on the device it will run on.

Contract:
- ``profile_blocks(blocks, sample, device, ...)`` returns one ``BlockCost`` per block for one
  micro-batch ``sample``: forward+backward seconds (the mean of the middle 60% of
  ``repeats`` samples, ``trimmed_mean``), the bytes of the activation it
  outputs, the bytes autograd keeps for its backward (counted through saved-tensor hooks,
  parameters excluded) and parameter+gradient+optimizer-state bytes (the optimizer is built
  with ``optimizer_factory`` and stepped once, so its state is measured, not assumed).
- Blocks are timed **chained, as a 1F1B stage runs them**: a window of consecutive blocks
  runs forward in order (each block's input its predecessor's output, detached, so the
  block's own time can be read), then ``in_flight`` more micro-batches' forwards run before
  its backward in reverse order, one forward per backward after that; so between a block's
  forward and its backward the other blocks and another micro-batch's forward run, with its
  graph alive, pushing weights and activations out of the caches as in a pipeline stage.
  The window that ends the model (with the loss) runs forward then backward at once, as a
  last stage does. (Timing each block alone, weights hot, under-predicted a stage of
  embedding + layers by 10–17%; chained without the interleaving, the layers of an
  embedding + layers stage still read ≈ 5% low against the head.) Repetitions interleave
  the blocks, so a burst of load from other processes hits every block of a repetition
  alike rather than one block's whole sample.
- Blocks may live on the meta device: a window's blocks are copied, materialised on
  ``device``, measured and freed. A window holds consecutive blocks of at most
  ``window_bytes`` parameter bytes (at least one block; ``None``: no limit), so profiling
  never holds more of the model than that; ``prepare`` passes the model's parameter bytes
  over the number of stages (what a stage holds on average anyway). Blocks already on a
  real device are measured in place and their gradients are cleared afterwards.
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


def _param_bytes_of(block: nn.Module) -> int:
    return sum(_bytes(p) for p in block.parameters())


def windows_by_bytes(sizes: Sequence[int], window_bytes: int | None) -> list[range]:
    """Consecutive index ranges whose ``sizes`` sum to at most ``window_bytes`` (a range of
    one when a single size is larger; ``None``: one range of everything). Pure."""
    if window_bytes is None:
        return [range(0, len(sizes))] if sizes else []
    out, first, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > first and total + size > window_bytes:
            out.append(range(first, i))
            first, total = i, 0
        total += size
    if first < len(sizes):
        out.append(range(first, len(sizes)))
    return out


def trimmed_mean(values: Sequence[float], cut: float = 0.2) -> float:
    """Mean of ``values`` without the lowest and highest ``cut`` fraction (0.0 if empty). Pure.

    Why not the median: a stage's time is the sum of its micro-batches' times, i.e. the mean,
    and a block whose samples are bimodal (the head: big fresh buffers, 20 or 30 ms) has a
    median that jumps between the modes from one profile to the next. Trimming still drops
    the bursts other processes cause."""
    ordered = sorted(values)
    drop = int(len(ordered) * cut)
    kept = ordered[drop:len(ordered) - drop] or ordered
    return statistics.fmean(kept) if kept else 0.0


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


def _timeable(block: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """``block`` itself, or a materialised copy (initialised under ``seed``) when it is on
    the meta device, so timing never allocates the caller's model."""
    on_meta = any(t.device.type == "meta" for t in [*block.parameters(), *block.buffers()])
    return materialize_module(copy.deepcopy(block), device, seed=seed) if on_meta else block


def _forward_chain(window: list[nn.Module], x: torch.Tensor, device: torch.device,
                   clock: Callable[[], float]) -> tuple[list, list, list[float]]:
    """``window`` forward in order, each block on its predecessor's output detached (so its
    own backward can be timed); (inputs, outputs, forward seconds per block)."""
    inputs, outputs, times = [], [], []
    for block in window:
        inp = x.detach().requires_grad_(x.is_floating_point())
        _sync(device)
        started = clock()
        x = block(inp)
        _sync(device)
        times.append(clock() - started)
        inputs.append(inp)
        outputs.append(x)
    return inputs, outputs, times


def _backward_chain(inputs: list, outputs: list, loss: Callable | None,
                    device: torch.device, clock: Callable[[], float]) -> list[float]:
    """Backward of a forwarded chain in reverse block order; seconds per block. ``loss(out)``,
    when given, ends the last block (its time includes it); else the last output's gradient
    is ones."""
    times = [0.0] * len(outputs)
    grad = None
    for i in range(len(outputs) - 1, -1, -1):
        _sync(device)
        started = clock()
        if not outputs[i].requires_grad:
            pass  # nothing to differentiate (e.g. a parameter-free block on integer input)
        elif i == len(outputs) - 1:
            if loss is not None:
                loss(outputs[i]).backward()
            else:
                outputs[i].backward(torch.ones_like(outputs[i]))
        else:
            outputs[i].backward(grad if grad is not None else torch.zeros_like(outputs[i]))
        _sync(device)
        times[i] = clock() - started
        grad = inputs[i].grad
    return times


def _time_window(window: list[nn.Module], x: torch.Tensor, loss: Callable | None,
                 device: torch.device, clock: Callable[[], float], runs: int,
                 in_flight: int) -> list[list[float]]:
    """``runs`` forward+backward seconds per block of ``window``, as 1F1B runs a stage:
    ``in_flight`` more micro-batches' forwards run between a micro-batch's forward and its
    backward (their graphs alive meanwhile), then backward, one forward per backward."""
    samples: list[list[float]] = [[] for _ in window]
    pending: list[tuple[list, list, list[float]]] = []
    for _ in range(runs + in_flight):
        pending.append(_forward_chain(window, x, device, clock))
        if len(pending) > in_flight:
            inputs, outputs, forward_s = pending.pop(0)
            for i, (f, b) in enumerate(zip(forward_s, _backward_chain(inputs, outputs, loss,
                                                                      device, clock))):
                samples[i].append(f + b)
    return samples


def profile_blocks(blocks: Sequence[nn.Module], sample: torch.Tensor,
                   device: torch.device | str = "cpu", *,
                   optimizer_factory: Callable | None = None,
                   loss_fn: Callable | None = None, sample_target: torch.Tensor | None = None,
                   warmup: int = 2, repeats: int = 21, seed: int = 0,
                   window_bytes: int | None = None, in_flight: int = 1,
                   block_inputs: list | None = None) -> list[BlockCost]:
    """One ``BlockCost`` per block, measured on ``device`` with one micro-batch ``sample``,
    chained in windows of at most ``window_bytes`` parameter bytes, with ``in_flight`` more
    micro-batches' forwards before each backward except in the window ending the model
    (module docstring). 1 is what stage 0 of a 2-stage 1F1B sees; more only holds more
    activations, the caches are flushed by one.

    ``block_inputs``, when a list, receives the input each block was timed on (detached;
    ``sample`` first), for ``time_stage`` to start a stage where the model reaches it.

    Blocks. Raises ``ValueError`` naming the block whose output is not a single tensor, or
    a negative ``in_flight``.
    """
    if in_flight < 0:
        raise ValueError(f"profile_blocks: in_flight={in_flight}; it counts micro-batches "
                         f"forwarded before a backward, so it must be 0 or more")
    device = torch.device(device)
    x = sample.to(device)
    target = sample_target.to(device) if sample_target is not None else None
    clock = compute_clock(device)
    costs: list[BlockCost] = []
    for span in windows_by_bytes([_param_bytes_of(b) for b in blocks], window_bytes):
        window, stashes, outs = [], [], []
        chain_in = x
        for index in span:
            original = blocks[index]
            block = _timeable(original, device, seed + index)
            if block_inputs is not None:
                block_inputs.append(x.detach())
            out, stash = _stash_bytes(block, x)
            if not isinstance(out, torch.Tensor):
                raise ValueError(f"pipeline block {index} ({type(original).__name__}) returned "
                                 f"{type(out).__name__}; every block must map one tensor to "
                                 f"one tensor")
            window.append(block)
            stashes.append(stash)
            outs.append(_bytes(out))
            x = out.detach()
        ends_model = span.stop == len(blocks) and loss_fn is not None and target is not None
        loss = (lambda out: loss_fn(out, target)) if ends_model else None
        depth = 0 if ends_model else in_flight
        samples = [s[warmup:] for s in _time_window(window, chain_in, loss, device, clock,
                                                   warmup + repeats, depth)]
        for i, (index, block) in enumerate(zip(span, window)):
            params = [p for p in block.parameters() if p.requires_grad]
            param_bytes = 2 * sum(_bytes(p) for p in params)  # weights and their gradients
            if optimizer_factory is not None and params:
                optimizer = optimizer_factory(params)
                optimizer.step()
                param_bytes += sum(_tensor_bytes(s) for s in optimizer.state.values())
                del optimizer
            block.zero_grad(set_to_none=True)
            costs.append(BlockCost(time_s=trimmed_mean(samples[i]),
                                   out_bytes=outs[i], param_bytes=param_bytes,
                                   stash_bytes=stashes[i],
                                   name=f"{index}:{type(blocks[index]).__name__}"))
        del window
    return costs


def time_stage(blocks: Sequence[nn.Module], first: int, stop: int, x: torch.Tensor,
               device: torch.device | str = "cpu", *, loss_fn: Callable | None = None,
               sample_target: torch.Tensor | None = None, seed: int = 0, in_flight: int = 1,
               warmup: int = 1, repeats: int = 9) -> float:
    """Forward+backward seconds per micro-batch of ``blocks[first:stop]`` run as one stage:
    chained, ``in_flight`` more forwards before each backward, as ``profile_blocks`` times a
    window, unless the stage ends the model (``stop == len(blocks)`` with ``loss_fn`` and
    ``sample_target``), which runs the loss and backward at once. ``x`` is the input of block
    ``first`` (``profile_blocks(block_inputs=...)``). Blocks on the meta device are
    materialised (``seed + index``) for the timing only. Trimmed mean over ``repeats``."""
    device = torch.device(device)
    window = [_timeable(blocks[index], device, seed + index) for index in range(first, stop)]
    ends_model = stop == len(blocks) and loss_fn is not None and sample_target is not None
    target = sample_target.to(device) if ends_model else None
    loss = (lambda out: loss_fn(out, target)) if ends_model else None
    samples = _time_window(window, x.to(device), loss, device, compute_clock(device),
                           warmup + repeats, 0 if ends_model else in_flight)
    for block in window:
        block.zero_grad(set_to_none=True)
    per_run = [sum(run) for run in zip(*samples)][warmup:]
    return trimmed_mean(per_run)


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

    # gloo moves host memory only: a GPU rank's messages go through a host copy, as the
    # lean runtime's do, and the copies are part of the link's cost
    staged = device.type != "cpu" and dist.get_backend(group) == "gloo"

    def send(buf):
        dist.send(buf.cpu() if staged else buf, peer, group=group)

    def recv(buf):
        if staged:
            host = torch.empty_like(buf, device="cpu")
            dist.recv(host, peer, group=group)
            buf.copy_(host)
        else:
            dist.recv(buf, peer, group=group)

    def round_trips(size: int) -> float:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats + 1):
            _sync(device)
            started = time.perf_counter()
            if rank == rank_a:
                send(buf)
                recv(buf)
            else:
                recv(buf)
                send(buf)
            _sync(device)
            times.append((time.perf_counter() - started) / 2)
        return min(times[1:])

    small = round_trips(4)
    large = round_trips(num_bytes)
    bandwidth = num_bytes / max(large - small, 1e-9)
    return Link(bandwidth_bytes_per_s=bandwidth, latency_s=small)
