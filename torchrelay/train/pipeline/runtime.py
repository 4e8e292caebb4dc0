"""Pipeline runtimes: a lean GPipe/1F1B over torch.distributed isend/irecv, and torch's own.

Contract (both runtimes, one object per rank, built by ``prepare``):
- ``step(inputs=None, targets=None)`` runs forward and backward of one batch split into
  ``microbatches`` along dim 0 (``torch.tensor_split``); stage 0 must pass ``inputs``, the
  last stage ``targets``. Gradients accumulate in the stage's parameters exactly as the
  unsplit model's would for ``loss_fn`` averaged over the batch (each micro-batch's loss is
  weighted by its share of the batch; torch's runtime weighs micro-batches equally, the same
  when the batch divides evenly); the caller steps its optimizer and zeroes gradients.
  Returns the batch loss (a detached scalar) on the last stage, None elsewhere. Blocks until
  this stage's part of the step is done; collective over the pipeline's ranks.
- With ``dp_group`` (replicas > 1), gradients are averaged over the stage's replicas at the
  end of ``step``.

Why a runtime of our own (``LeanPipeline``): torch.distributed.pipelining spends more CPU
per micro-batch on bookkeeping (bench/pipeline.py prints CPU time per step; for 2 stages × 8
MLP micro-batches on a shared machine, over the unsplit model: torch 1F1B +14–42% and GPipe
+34–69%, this runtime +8–27% and +5–18%; see docs/pipeline.md). This one posts every receive
of the step at its start into buffers allocated once per input shape, sends with ``isend``
and waits for sends only at the end of the step, so communication overlaps compute and
nothing is copied. Shapes are not exchanged per micro-batch: stage 0 sends one 10-integer
header per step (dtype and batch shape) along the chain; only the first step of a new shape
sends each activation's shape ahead of it (running the blocks on the meta device instead
costs seconds of lazy imports). It assumes point-to-point messages are matched by tag
(gloo); on NCCL ``prepare`` uses torch's runtime. Neighbours on the same host
(``prev_channel``/``next_channel``, see shm.py) use gloo only for the first step of a shape;
from then on activations and gradients go through shared-memory slots with a one-byte signal
each (no gloo threads, at most one wake-up per message), and the per-step header goes over
the same channel. A stage on a GPU (device not CPU) sends and receives through host copies,
since gloo moves host memory only; that lets a GPU stage and a CPU stage share a pipeline.

On every stage but the first, the step's last backward is split (input gradient first, sent
at once; then the weights' gradients while the previous stage runs its own last backward),
which shortens the pipeline's drain; gradients are the same (not for blocks sharded by FSDP:
``split_backward=False``, the gradients of the gathered parameters must go through FSDP's
hooks). ``last_trace`` records the last
step's CPU time per action and ``replay_step`` turns the stages' traces into the step on
idle cores (docs/pipeline.md, "Traces and replay").
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchrelay.errors import InvalidSpec
from torchrelay.train.pipeline.profile import compute_clock

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.uint8, torch.bool)
_HEADER_LEN = 10
_HEADER_TAG = 0
_DESC_TAG = 1 << 20


def schedule_actions(schedule: str, stage: int, num_stages: int, microbatches: int
                     ) -> list[tuple[str, int]]:
    """The order of forward ("F", m) and backward ("B", m) work on ``stage``. Pure.

    GPipe: every forward, then every backward. 1F1B: ``num_stages - stage - 1`` warm-up
    forwards, then alternate one forward and one backward, then the remaining backwards.
    """
    if schedule == "gpipe":
        return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    if schedule != "1f1b":
        raise InvalidSpec(f"pipeline: lean runtime schedule {schedule!r}; use 'gpipe' or '1f1b'")
    warmup = min(num_stages - stage - 1, microbatches)
    actions = [("F", m) for m in range(warmup)]
    next_b = 0
    for m in range(warmup, microbatches):
        actions += [("F", m), ("B", next_b)]
        next_b += 1
    actions += [("B", m) for m in range(next_b, microbatches)]
    return actions


def replay_step(traces: Sequence[Sequence[tuple[str, int, float]]]) -> float:
    """The step a pipeline's stages would take with no waiting but for each other: replay
    each stage's ``last_trace`` (``traces[k]`` for stage ``k``) in order, starting an action
    when its stage is free and its input is there (forward ``m`` after the previous stage's
    forward ``m``, backward ``m`` after the next stage's backward ``m``; with a split
    backward, the next stage's input part). Messages cost nothing. Pure.

    Raises ``ValueError`` when the traces cannot finish (an action waits for one that never
    comes)."""
    num = len(traces)
    done: dict[tuple[int, str, int], float] = {}
    clock, nxt = [0.0] * num, [0] * num
    remaining = sum(len(t) for t in traces)
    while remaining:
        progressed = False
        for k, trace in enumerate(traces):
            while nxt[k] < len(trace):
                kind, m, seconds = trace[nxt[k]]
                dep = (k - 1, "F", m) if kind == "F" and k > 0 else \
                    (k + 1, "B", m) if kind == "B" and k < num - 1 else None
                if dep is not None and dep not in done:
                    break
                clock[k] = max(clock[k], done[dep] if dep else 0.0) + seconds
                done[(k, kind, m)] = clock[k]
                nxt[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [traces[k][nxt[k]] for k in range(num) if nxt[k] < len(traces[k])]
            raise ValueError(f"pipeline traces cannot finish: waiting are {stuck}")
    return max(clock, default=0.0)


def microbatch_sizes(batch: int, microbatches: int) -> list[int]:
    """Sizes ``torch.tensor_split`` gives. Raises ``InvalidSpec`` if a micro-batch is empty."""
    if batch < microbatches:
        raise InvalidSpec(f"pipeline: batch of {batch} cannot make {microbatches} micro-batches; "
                          f"use a batch of at least {microbatches}")
    base, extra = divmod(batch, microbatches)
    return [base + (1 if m < extra else 0) for m in range(microbatches)]


class LeanPipeline:
    """One stage of a GPipe or 1F1B pipeline over isend/irecv (see module docstring)."""

    def __init__(self, module: nn.Module, *, stage: int, num_stages: int, microbatches: int,
                 loss_fn: Callable, schedule: str, prev_rank: int | None,
                 next_rank: int | None, device: torch.device,
                 dp_group=None, group=None, prev_channel=None, next_channel=None,
                 split_backward: bool = True):
        self.module, self.stage, self.num_stages = module, stage, num_stages
        # same-host neighbours talk through shared memory (shm.py), others through gloo
        self.prev_channel, self.next_channel = prev_channel, next_channel
        self.microbatches, self.loss_fn, self.schedule = microbatches, loss_fn, schedule
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self.dp_group, self.group = dp_group, group
        self.actions = schedule_actions(schedule, stage, num_stages, microbatches)
        self._buffers: dict[tuple, tuple[list, list]] = {}  # header -> (inputs, grads)
        self._header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        self.last_busy_s = 0.0  # compute seconds (forward, loss, backward) of the last step
        # The last step as ("S", -1, s) set-up, then each action ("F"/"B", m, s) and, for a
        # split backward, its weights' part ("W", m, s), then ("E", -1, s) the rest: seconds
        # of this stage's clock from the end of the previous record. With the CPU clock
        # waiting costs nothing, so replaying the stages' traces with their dependencies
        # gives the step on idle cores (bench/pipeline.py does).
        self.last_trace: list[tuple[str, int, float]] = []
        self._clock = compute_clock(device)  # the profiler's clock: like compares with like
        # gloo moves host memory only: a stage on a GPU sends and receives through host
        # copies of its activations and gradients (a CPU neighbour then needs none)
        self._staged = torch.device(device).type != "cpu"
        self._params = [p for p in module.parameters() if p.requires_grad]
        # off after a graph the split cannot handle (_backward_input), and for FSDP-sharded blocks,
        # whose gradients reach the shards only through FSDP's own hooks on the whole backward
        self._split_last = split_backward
        # For the split: the stage's blocks and each one's trainable parameters. A plain
        # Sequential without hooks runs its children in turn, so they are the blocks; any
        # other module (a subclass may change forward) is one block.
        plain = type(module) is nn.Sequential and not (module._forward_hooks or
                                                       module._forward_pre_hooks)
        self._blocks = list(module) if plain else [module]
        self._block_params = [[p for p in b.parameters() if p.requires_grad]
                              for b in self._blocks]
        # A parameter used by two blocks (a repeated layer) takes gradient from both: the
        # weights' part then runs as one backward over the whole stage.
        owned = [id(p) for params in self._block_params for p in params]
        if len(owned) != len(set(owned)):
            self._blocks, self._block_params = [module], [self._params]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # -- shapes

    def _exchange_header(self, inputs: torch.Tensor | None) -> tuple[int, ...]:
        header = self._header
        if self.is_first:
            if inputs.dim() > _HEADER_LEN - 2:
                raise InvalidSpec(f"pipeline: inputs of {inputs.dim()} dims; at most "
                                  f"{_HEADER_LEN - 2} are supported")
            header.zero_()
            header[0] = _DTYPES.index(inputs.dtype)
            header[1] = inputs.dim()
            header[2:2 + inputs.dim()] = torch.tensor(inputs.shape)
        elif self.prev_channel is not None:
            header.copy_(torch.frombuffer(bytearray(
                self.prev_channel.read_exact(_HEADER_LEN * 8)), dtype=torch.int64))
        else:
            dist.recv(header, self.prev_rank, group=self.group, tag=_HEADER_TAG)
        if self.next_channel is not None:
            self.next_channel.write(header.numpy().tobytes())
        elif not self.is_last:
            dist.send(header, self.next_rank, group=self.group, tag=_HEADER_TAG)
        return tuple(header.tolist())

    # -- the step

    # One long frame on purpose: this is the per-micro-batch hot loop. Its state (buffers,
    # pending receives, shared-memory signal counts, the trace) lives in locals that each
    # action reads and writes; bench/pipeline.py's figures sit at their goals with a margin of
    # a few percent, so a split into methods must be measured side by side with that bench.
    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
             ) -> torch.Tensor | None:
        if self.is_first and inputs is None:
            raise InvalidSpec("pipeline: stage 0 must pass inputs to step()")
        if self.is_last and targets is None:
            raise InvalidSpec(f"pipeline: the last stage ({self.stage}) must pass targets")
        clock = self._clock
        mark = clock()  # start of the current trace segment (see last_trace)
        trace: list[tuple[str, int, float]] = []
        key = self._exchange_header(inputs)
        batch = key[2]
        sizes = microbatch_sizes(batch, self.microbatches)
        group, m_count = self.group, self.microbatches
        # Buffers are made once per input shape. The first step of a shape sends each
        # activation's shape before it (the receiver cannot know it); later steps post every
        # receive of the step at once, straight into the cached buffers.
        known = key in self._buffers
        if known:
            in_bufs, grad_bufs = self._buffers[key]
        else:
            in_bufs, grad_bufs = [None] * m_count, [None] * m_count
        prev, nxt = self.prev_rank, self.next_rank
        prev_ch, next_ch = self.prev_channel, self.next_channel
        # Same-host neighbours have shared slots from the second step of a shape on.
        prev_shm = prev_ch.regions.get(key) if prev_ch is not None else None
        next_shm = next_ch.regions.get(key) if next_ch is not None else None
        if prev_shm is not None:
            in_bufs = prev_shm.acts
        if next_shm is not None:
            grad_bufs = next_shm.grads
        act_recvs: list = [None] * m_count
        grad_recvs: list = [None] * m_count
        if known:
            if not self.is_first and prev_shm is None:
                act_recvs = [dist.irecv(buf, prev, group=group, tag=1 + 2 * m)
                             for m, buf in enumerate(in_bufs)]
            if not self.is_last and next_shm is None:
                grad_recvs = [dist.irecv(buf, nxt, group=group, tag=2 + 2 * m)
                              for m, buf in enumerate(grad_bufs)]
        if self.is_first:
            chunks = torch.tensor_split(inputs.to(self.device), m_count)
        if self.is_last:
            target_chunks = torch.tensor_split(targets.to(self.device), m_count)
        stage_inputs: list = [None] * m_count
        outputs: list = [None] * m_count
        sends = []
        acts_ready = grads_ready = 0  # shared-memory "slot ready" signals seen this step
        total_loss = torch.zeros((), device=self.device)
        busy = 0.0
        split_inputs: list = []  # the split micro-batch's block inputs (first = stage input)
        split_grads: tuple = ()
        last_b = self.actions[-1][1]
        now = clock()
        trace.append(("S", -1, now - mark))
        mark = now
        for kind, m in self.actions:
            if kind == "F":
                if self.is_first:
                    x = chunks[m]
                else:
                    if not known:
                        in_bufs[m] = self._recv_described(prev, m)
                    elif prev_shm is not None:
                        while acts_ready <= m:  # one read takes every signal already there
                            acts_ready += len(prev_ch.read_some(m_count - acts_ready))
                    else:
                        act_recvs[m].wait()
                    x = in_bufs[m].to(self.device) if self._staged else in_bufs[m]
                    x = x.detach().requires_grad_(x.is_floating_point())
                stage_inputs[m] = x
                started = clock()
                if m == last_b and self._split_last and not self.is_first:
                    # keep each block's input: the split backward needs their gradients
                    out, split_inputs = x, []
                    for block in self._blocks:
                        split_inputs.append(out)
                        out = block(out)
                else:
                    out = self.module(x)
                if self.is_last:
                    loss = self.loss_fn(out, target_chunks[m]) * (sizes[m] / batch)
                    total_loss += loss.detach()
                    outputs[m] = loss
                    busy += clock() - started
                else:
                    busy += clock() - started
                    outputs[m] = out
                    if next_shm is not None:
                        slot = next_shm.acts[m]
                        if slot.shape != out.shape or slot.dtype != out.dtype:
                            raise InvalidSpec(
                                f"pipeline: stage {self.stage} output {m} is {out.dtype} "
                                f"{tuple(out.shape)} but was {slot.dtype} {tuple(slot.shape)} "
                                f"for the same input shape; stage outputs must depend only "
                                f"on the input shape")
                        slot.copy_(out.detach())
                        next_ch.write(b"F")
                        now = clock()
                        trace.append(("F", m, now - mark))
                        mark = now
                        continue
                    send_buf = out.detach().contiguous()
                    if self._staged:
                        send_buf = send_buf.cpu()
                    if not known:
                        self._send_description(send_buf, nxt, m)
                        grad_bufs[m] = torch.empty_like(send_buf)
                        grad_recvs[m] = dist.irecv(grad_bufs[m], nxt, group=group, tag=2 + 2 * m)
                    sends.append((dist.isend(send_buf, nxt, group=group, tag=1 + 2 * m),
                                  send_buf))
            else:
                # The step's last backward, on every stage but the first, is split: the
                # input's gradient first, sent upstream at once, then the weights' gradients
                # while the previous stage already runs its own last backward (the drain).
                split = m == last_b and self._split_last and not self.is_first
                grad_out = None
                if not self.is_last:
                    if next_shm is not None:
                        while grads_ready <= m:
                            grads_ready += len(next_ch.read_some(m_count - grads_ready))
                    else:
                        grad_recvs[m].wait()
                    grad_out = grad_bufs[m].to(self.device) if self._staged else grad_bufs[m]
                started = clock()
                if split:
                    split_grads = self._backward_input(outputs[m], grad_out, split_inputs)
                    split = bool(split_grads)
                if not split:
                    torch.autograd.backward(outputs[m], grad_out)
                busy += clock() - started
                if not self.is_first:
                    grad = stage_inputs[m].grad
                    if grad is None:
                        grad = torch.zeros_like(stage_inputs[m])
                    if prev_shm is not None:
                        prev_shm.grads[m].copy_(grad)
                        prev_ch.write(b"B")
                    else:
                        grad = grad.cpu() if self._staged else grad.contiguous()
                        sends.append((dist.isend(grad, prev, group=group, tag=2 + 2 * m), grad))
                if split:
                    now = clock()
                    trace.append(("B", m, now - mark))
                    mark = now
                    self._backward_weights(outputs[m], grad_out, split_inputs, split_grads)
                    split_inputs, split_grads = [], ()
                    busy += clock() - now
                    kind = "W"  # the trace's record of the weights' part
                outputs[m] = stage_inputs[m] = None
            now = clock()
            trace.append((kind, m, now - mark))
            mark = now
        for work, _ in sends:
            work.wait()
        if not known:
            self._buffers[key] = (in_bufs, grad_bufs)
            # The first step of a shape ran on gloo and learnt the shapes; map shared slots
            # for the next ones (previous neighbour first: the chain cannot deadlock).
            if prev_ch is not None:
                prev_ch.open_region(key, [(tuple(b.shape), b.dtype) for b in in_bufs])
            if next_ch is not None:
                next_ch.open_region(key, [(tuple(b.shape), b.dtype) for b in grad_bufs])
        self.last_busy_s = busy
        self.last_trace = trace
        trace.append(("E", -1, clock() - mark))
        if self.dp_group is not None:
            average_gradients(self.module, self.dp_group)
        return total_loss if self.is_last else None

    def _backward_input(self, output: torch.Tensor, grad: torch.Tensor | None,
                        block_inputs: list[torch.Tensor]) -> tuple:
        """The gradients of every block's input (``block_inputs[0]`` is the stage input, whose
        gradient goes to its ``.grad``), keeping the graph for ``_backward_weights``. Returns
        them, or ``()`` (nothing computed: run the plain backward, as every later step will)
        when the stage input takes no gradient or the graph cannot be differentiated so.

        Why by hand: this pass skips every weight-gradient product, and with each block's
        output gradient kept, the weights' part then computes only each block's own weight
        products (it redid the chain's input-side products when only the stage input's
        gradient was kept: 0.9 + 2.1 ms against 2.2 ms in one pass for an MLP stage).
        torch's own split (``pipelining._backward``, for its zero-bubble schedules) walks
        the graph in Python and took 1.3 + 2.5 ms."""
        if not block_inputs or not block_inputs[0].requires_grad or not self._params:
            return ()
        try:
            grads = torch.autograd.grad(output, block_inputs, grad, retain_graph=True,
                                        allow_unused=True)
        except RuntimeError:
            self._split_last = False
            return ()
        if grads[0] is None:
            self._split_last = False
            return ()
        block_inputs[0].grad = grads[0]
        return grads

    def _backward_weights(self, output: torch.Tensor, grad: torch.Tensor | None,
                          block_inputs: list[torch.Tensor], grads: tuple) -> None:
        """The weights' gradients after ``_backward_input``, accumulated into ``.grad``:
        block ``j``'s from its output's gradient (the next block's input's, or the stage
        output's), so no block's input-side products run twice. A block whose output took
        no gradient (``None``) gets none, as in the plain backward."""
        last = len(self._blocks) - 1
        for j, params in enumerate(self._block_params):
            if not params:
                continue
            if j < last:
                if grads[j + 1] is None or block_inputs[j + 1].grad_fn is None:
                    continue
                root, root_grad = block_inputs[j + 1], grads[j + 1]
            else:
                root, root_grad = output, grad
            torch.autograd.backward(root, root_grad, inputs=params)

    def _send_description(self, tensor: torch.Tensor, dst: int, m: int) -> None:
        if tensor.dim() > _HEADER_LEN - 2:
            raise InvalidSpec(f"pipeline: stage {self.stage} outputs {tensor.dim()} dims; at "
                              f"most {_HEADER_LEN - 2} are supported")
        desc = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        desc[0], desc[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        desc[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(desc, dst, group=self.group, tag=_DESC_TAG + m)

    def _recv_described(self, src: int, m: int) -> torch.Tensor:
        desc = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        dist.recv(desc, src, group=self.group, tag=_DESC_TAG + m)
        values = desc.tolist()
        buf = torch.empty(values[2:2 + values[1]], dtype=_DTYPES[values[0]],
                          device="cpu" if self._staged else self.device)
        dist.recv(buf, src, group=self.group, tag=1 + 2 * m)
        return buf


def average_gradients(module: nn.Module, group) -> None:
    """Average ``module``'s gradients over ``group`` in one flat all-reduce. Collective."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


class TorchPipeline:
    """One rank of a ``torch.distributed.pipelining`` schedule (GPipe, 1F1B, interleaved)."""

    def __init__(self, modules: Sequence[nn.Module], stage_indices: Sequence[int], *,
                 num_stages: int, microbatches: int, loss_fn: Callable, schedule: str,
                 device: torch.device, group=None, dp_group=None):
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)
        self.modules = list(modules)
        self.stage_indices = list(stage_indices)
        self.num_stages, self.microbatches = num_stages, microbatches
        self.dp_group = dp_group
        self.stages = [PipelineStage(mod, idx, num_stages, device, group=group)
                       for mod, idx in zip(self.modules, self.stage_indices)]
        if schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, microbatches, loss_fn=loss_fn)
        elif len(self.stages) != 1:
            raise InvalidSpec(f"pipeline: schedule {schedule!r} takes one stage per rank, "
                              f"not {len(self.stages)}")
        else:
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(schedule)
            if cls is None:
                raise InvalidSpec(f"pipeline: schedule {schedule!r} is not one of "
                                  f"gpipe, 1f1b, interleaved_1f1b")
            self.schedule = cls(self.stages[0], microbatches, loss_fn=loss_fn)
        self.is_first = 0 in self.stage_indices
        self.is_last = num_stages - 1 in self.stage_indices

    # One long frame on purpose: this is the per-micro-batch hot loop. Its state (buffers,
    # pending receives, shared-memory signal counts, the trace) lives in locals that each
    # action reads and writes; bench/pipeline.py's figures sit at their goals with a margin of
    # a few percent, so a split into methods must be measured side by side with that bench.
    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
             ) -> torch.Tensor | None:
        if self.is_first and inputs is None:
            raise InvalidSpec("pipeline: stage 0 must pass inputs to step()")
        if self.is_last and targets is None:
            raise InvalidSpec("pipeline: the last stage must pass targets")
        losses: list = []
        # torch's stages check each micro-batch's strides against the first (2.11 does):
        # a sliced batch (tokens[:, :-1]) is made contiguous first
        args = (inputs.contiguous(),) if self.is_first else ()
        kwargs = {"target": targets.contiguous(), "losses": losses} if self.is_last else {}
        self.schedule.step(*args, **kwargs)
        if self.dp_group is not None:
            for module in self.modules:
                average_gradients(module, self.dp_group)
        if self.is_last:
            return torch.stack([loss.detach() for loss in losses]).mean()
        return None
