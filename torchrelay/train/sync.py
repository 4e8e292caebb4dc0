"""How often replicas agree: ddp, local SGD, DiLoCo and one-shot final averaging.

``prepare(model, optimizer, strategy, ctx) -> (model, optimizer)`` applies one strategy from
``torchrelay.spec`` as two transforms: a model transform (only ``ddp``
wraps the model, in ``DistributedDataParallel``) and an optimizer transform, ``SyncOptimizer``,
that wraps the user's optimizer and runs a list of ``SyncRule`` objects around each local step:

====================  =====================================================================
strategy              rules (step ``k`` counts completed optimizer steps from 1)
====================  =====================================================================
ddp                   none (DDP all-reduces gradients in backward; a comm hook counts bytes)
local_sgd             ``GradientAverage`` for k <= warmup_steps, then ``ParameterAverage``
                      after step k when (k - warmup_steps) % every == 0
diloco                ``DiLoCoOuter``: every ``every`` steps the averaged delta from the
                      last global parameters goes through an outer Nesterov-momentum SGD
final_average         ``FinalAverage``: no communication while training; parameters are
                      averaged by ``finish()`` and by ``before_checkpoint()``
====================  =====================================================================

Contract:
- ``SyncOptimizer`` is a ``train.prepared.StrategyOptimizer``: ``metrics``, ``per_replica_tensors``,
  ``before_checkpoint``, ``finish`` and ``inner`` below are the hooks the library calls.
- Collectives go over the default process group (gloo on CPU, nccl on GPU); every rank must
  make the same calls in the same order (``step``, ``finish``, ``before_checkpoint``).
- ``prepare`` broadcasts rank 0's parameters first (DDP does the same), so replicas start equal.
- ``SyncOptimizer.metrics()`` gives the rank's peak memory by kind (``memory_*``, train.memory_meter),
  ``bytes_sent`` (bytes this process handed to collectives
  during the last step: counted where each collective is called, not estimated),
  ``bytes_sent_total`` and, after a step that synchronised parameters, ``divergence``:
  ``||theta_rank - mean(theta)|| / ||mean(theta)||`` over all synchronised parameters.
- ``state_dict()`` holds the inner optimizer's state, the step counter and each rule's state
  (DiLoCo's global parameters and outer optimizer), so a resumed job keeps its schedule.
- ``per_replica_tensors()`` names what differs between ranks now, so that a checkpoint keeps
  one copy per rank of it (``torchrelay.train.checkpoint``): for local_sgd, diloco and
  final_average the inner optimizer's state and the model's buffers always, the parameters
  between sync points; nothing for ddp or in a world of 1.
- ``finish()`` (and the module's ``finish(model, optimizer)``) averages replicas that differ
  at the end; ``before_checkpoint()`` does so for final_average only. Both are idempotent.
- local_sgd's warm-up averages gradients inside ``step()``, not in backward: gradient
  clipping placed before ``step()`` sees local gradients there (ddp's sees averaged ones).
- Only trainable parameters are synchronised (like ``torch.distributed``'s model averagers);
  buffers are not. With world size 1 no collective is called and nothing is wrapped.
- Every step is timed (``train.balance.StepClock``): ``metrics()`` also gives ``compute_s``,
  ``allreduce_wait_s`` (waiting for the all-reduce after this rank's gradients were ready, or
  inside a blocking collective) and ``idle_fraction`` (that wait over the step's time), from
  the second step on, for every strategy here, balanced or not.
- ``balance: throughput`` (ddp, local_sgd, diloco; ``train.balance.Balancer``): ranks train
  local batches of different sizes; DDP's comm hook scales each rank's gradient by
  ``b_i / B`` and sums, so the step's gradient is the whole batch's; gradient warm-up does the
  same, and parameter averages weigh each replica by the samples it trained since the last
  sync. ``prepare`` agrees the first split with every rank (collective): in proportion to each
  rank's CPU allowance (``train.cpu_allowance``) when all are on the CPU, else even.
  ``step()`` counts the step for the balancer, which re-splits when due (collective).
  ``metrics()`` adds ``share``, ``measured_samples_per_s`` and ``resplits``.
- ddp on 2 gloo ranks, both on CPU: the last gradient bucket (a small model's only one) is
  summed by one exchange of the whole bucket (``train.exchange.PeerSum``, its next receive posted
  a step ahead), not gloo's ring; the same sum bit for bit. ``RELAY_PAIRWISE=0`` keeps gloo's
  all-reduce; so does a CPU rank beside a GPU one (the ranks agree in ``apply_ddp``,
  ``train.exchange.agreed``).
- ``apply_ddp`` keeps the process group it wraps referenced until the process ends, so that
  freeing the model after ``shutdown()`` never destroys the group inside DDP's reducer (a hang:
  see ``_GROUPS_OUTLIVING_REDUCERS``).
"""
from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from pydantic import ValidationError

from torchrelay.errors import InvalidSpec
from torchrelay.spec import (
    DDPStrategy,
    DiLoCoStrategy,
    FinalAverageStrategy,
    LocalSGDStrategy,
    describe_validation_error,
)
from torchrelay.train import exchange
from torchrelay.train.balance import Balancer, StepClock, balancer_for
from torchrelay.train.cpu_allowance import cpu_allowance
from torchrelay.train.environment import validate_strategy
from torchrelay.train.memory_meter import MemoryMeter
from torchrelay.train.prepared import StrategyOptimizer

__all__ = [
    "Context", "SyncOptimizer", "SyncRule", "GradientAverage", "ParameterAverage", "DiLoCoOuter",
    "FinalAverage", "Collective", "PeriodicSchedule", "prepare", "finish", "build_rules",
    "SYNC_KINDS",
]

SYNC_KINDS = ("ddp", "local_sgd", "diloco", "final_average")


class Context(Protocol):
    """What ``prepare`` needs to know about this worker (``torchrelay.train``'s context fits)."""

    rank: int
    world_size: int
    device: torch.device | str


# ---------------------------------------------------------------- pure schedule


@dataclass(kw_only=True, slots=True, frozen=True)
class PeriodicSchedule:
    """Which steps communicate. Pure; ``step`` is the 1-based index of an optimizer step.

    Steps 1..warmup_steps all-reduce gradients (post-local SGD's warm-up); after that,
    parameters are synchronised after every ``every``-th step.
    """

    every: int
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise InvalidSpec(f"strategy.every={self.every!r} must be an integer >= 1")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise InvalidSpec(f"strategy.warmup_steps={self.warmup_steps!r} must be an integer >= 0")

    def averages_gradients(self, step: int) -> bool:
        return 1 <= step <= self.warmup_steps

    def syncs_parameters(self, step: int) -> bool:
        return step > self.warmup_steps and (step - self.warmup_steps) % self.every == 0

    def syncs_in(self, first: int, last: int) -> int:
        """Number of parameter syncs among steps first..last (inclusive)."""
        return sum(self.syncs_parameters(k) for k in range(first, last + 1))


# ---------------------------------------------------------------- counted collectives


class Collective:
    """All-reduce and broadcast over the default group, counting the bytes handed to them.

    ``bytes`` are the sizes of the tensors this process passes to a collective. On two
    ranks that equals what a ring all-reduce puts on the wire per process; on W ranks a
    ring sends 2(W-1)/W of it. With world size 1 nothing is called and nothing counted.
    """

    def __init__(self, world_size: int, *, clock: StepClock | None = None,
                 weights: Balancer | None = None) -> None:
        self.world_size = world_size
        self.pending_bytes = 0
        self.total_bytes = 0
        self.clock = clock or StepClock(overlapped=False)  # blocking collectives count as idle
        self.weights = weights  # balanced: each rank's part of an average (else 1 / world)
        self.peer_sum: exchange.PeerSum | None = None  # ddp's last bucket on 2 ranks: set by apply_ddp, agreed by all

    def count(self, nbytes: int) -> None:
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def take_pending(self) -> int:
        """Bytes counted since the last call (one step's worth). Resets the pending count."""
        out, self.pending_bytes = self.pending_bytes, 0
        return out

    def average_(self, flat: torch.Tensor, of: str = "parameters") -> torch.Tensor:
        """In place: ``flat`` becomes the mean of every rank's ``flat``; balanced, the weighted
        sum (``of`` "gradients": by this step's samples, "parameters": by the samples since the
        last parameter sync). Blocks."""
        if self.world_size > 1:
            self.count(flat.numel() * flat.element_size())
            if self.weights is not None:
                flat.mul_(self.weights.gradient_weight() if of == "gradients" else self.weights.parameter_weight())
            with self.clock.in_collective():
                # gloo has no ReduceOp.AVG: sum, then divide.
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            if self.weights is None:
                flat.div_(self.world_size)
        return flat

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0, counted: bool = True) -> None:
        """In place: every rank's ``tensors`` become rank ``src``'s. Blocks."""
        if self.world_size <= 1:
            return
        for group in _by_dtype(tensors):
            flat = _flatten(group)
            if counted:
                self.count(flat.numel() * flat.element_size())
            dist.broadcast(flat, src=src)
            _unflatten_into(flat, group)


def _by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.detach().copy_(flat[offset:offset + n].view_as(t))
        offset += n


def _views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


@torch.no_grad()
def average_parameters(params: Sequence[torch.Tensor], comm: Collective) -> float:
    """Replace ``params`` by their mean over ranks; return this rank's divergence (see module doc)."""
    diff_sq, mean_sq = 0.0, 0.0
    for group in _by_dtype(params):
        flat = comm.average_(_flatten(group))
        for p, mean in zip(group, _views(flat, group)):
            diff_sq += float(torch.sum((p.detach().double() - mean.double()) ** 2))
        mean_sq += float(torch.sum(flat.double() ** 2))
        _unflatten_into(flat, group)
    return _ratio(diff_sq, mean_sq)


def _ratio(diff_sq: float, mean_sq: float) -> float:
    return math.sqrt(diff_sq) / math.sqrt(mean_sq) if mean_sq > 0 else 0.0


# ---------------------------------------------------------------- rules


class SyncRule(ABC):
    """One synchronisation behaviour, run by ``SyncOptimizer`` around the local step.

    Hooks return a divergence when they synchronised parameters, else None.
    """

    def __init__(self, params: Sequence[torch.Tensor], comm: Collective) -> None:
        self.params = list(params)
        self.comm = comm
        self.synced_at = 0  # last step after which replicas were known identical

    def before_step(self, step: int) -> None:
        """Called before the inner optimizer takes step ``step`` (grads are ready)."""

    @abstractmethod
    def after_step(self, step: int) -> float | None:
        """Called after the inner optimizer took step ``step``."""

    def on_checkpoint(self, step: int) -> float | None:
        return None

    def on_finish(self, step: int) -> float | None:
        """Make replicas equal at the end if they are not. Idempotent for an unchanged ``step``."""
        if step > self.synced_at:
            self.synced_at = step
            return average_parameters(self.params, self.comm)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"synced_at": self.synced_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.synced_at = int(state.get("synced_at", 0))


class GradientAverage(SyncRule):
    """All-reduce gradients before steps 1..``until_step`` (local SGD's warm-up)."""

    def __init__(self, params: Sequence[torch.Tensor], comm: Collective, *, until_step: int) -> None:
        super().__init__(params, comm)
        self.until_step = until_step

    @torch.no_grad()
    def before_step(self, step: int) -> None:
        if step > self.until_step:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        for group in _by_dtype(grads):
            flat = self.comm.average_(_flatten(group), of="gradients")
            _unflatten_into(flat, group)

    def after_step(self, step: int) -> float | None:
        if step <= self.until_step:
            self.synced_at = step
        return None

    def on_finish(self, step: int) -> float | None:
        return None  # ParameterAverage (its partner) owns the end-of-training average


class ParameterAverage(SyncRule):
    """Average parameters after the steps ``schedule`` names (local SGD)."""

    def __init__(self, params: Sequence[torch.Tensor], comm: Collective, *, schedule: PeriodicSchedule) -> None:
        super().__init__(params, comm)
        self.schedule = schedule

    def after_step(self, step: int) -> float | None:
        if self.schedule.averages_gradients(step):
            self.synced_at = step
            return None
        if self.schedule.syncs_parameters(step):
            self.synced_at = step
            return average_parameters(self.params, self.comm)
        return None


class FinalAverage(SyncRule):
    """No communication while training; average at checkpoints and at the end."""

    def after_step(self, step: int) -> float | None:
        return None

    def on_checkpoint(self, step: int) -> float | None:
        return self.on_finish(step)


class DiLoCoOuter(SyncRule):
    """DiLoCo (Douillard et al., 2023): every ``every`` steps, outer SGD on the averaged delta.

    Keeps the global parameters ``theta_g`` from the last sync. At a sync the pseudo-gradient
    ``mean_r(theta_g - theta_r)`` is applied to ``theta_g`` by SGD with Nesterov momentum, and
    every replica restarts from the new ``theta_g``. With outer_lr=1 and momentum 0 this is
    exactly parameter averaging.
    """

    def __init__(self, params: Sequence[torch.Tensor], comm: Collective, *,
                 every: int, outer_lr: float, outer_momentum: float) -> None:
        super().__init__(params, comm)
        self.schedule = PeriodicSchedule(every=every)
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.global_params = [p.detach().clone() for p in self.params]
        self.outer_optimizer = torch.optim.SGD(
            self.global_params, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)

    @torch.no_grad()
    def after_step(self, step: int) -> float | None:
        if not self.schedule.syncs_parameters(step):
            return None
        self.synced_at = step
        diff_sq, mean_sq = 0.0, 0.0
        for idx in _by_dtype_indices(self.params):
            local = [self.params[i] for i in idx]
            glob = [self.global_params[i] for i in idx]
            flat = _flatten(glob) - _flatten(local)           # this replica's delta
            flat = self.comm.average_(flat)                    # pseudo-gradient
            for i, g_param, p, delta in zip(idx, glob, local, _views(flat, glob)):
                mean = g_param.double() - delta.double()
                diff_sq += float(torch.sum((p.double() - mean) ** 2))
                mean_sq += float(torch.sum(mean ** 2))
                g_param.grad = delta.clone()
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for p, g_param in zip(self.params, self.global_params):
            p.copy_(g_param)
        return _ratio(diff_sq, mean_sq)

    @torch.no_grad()
    def on_finish(self, step: int) -> float | None:
        divergence = super().on_finish(step)
        if divergence is not None:
            for p, g_param in zip(self.params, self.global_params):
                g_param.copy_(p)
        return divergence

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "global_params": [g.detach().clone() for g in self.global_params],
                "outer_optimizer": self.outer_optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state["global_params"]
        if len(saved) != len(self.global_params):
            raise InvalidSpec(f"diloco checkpoint holds {len(saved)} global parameters, "
                              f"this model has {len(self.global_params)}; resume with the same model")
        for g_param, value in zip(self.global_params, saved):
            if g_param.shape != value.shape:
                raise InvalidSpec(f"diloco checkpoint parameter shape {tuple(value.shape)} does not "
                                  f"match the model's {tuple(g_param.shape)}; resume with the same model")
            g_param.copy_(value)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for group in self.outer_optimizer.param_groups:  # the job's spec wins over the checkpoint's
            group.update(lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)


def _by_dtype_indices(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


# ---------------------------------------------------------------- optimizer transform


class SyncOptimizer(torch.optim.Optimizer, StrategyOptimizer):
    """Wraps the user's optimizer: ``step()`` = rules' ``before_step``, local step, rules' ``after_step``.

    Shares ``param_groups`` and ``state`` with the inner optimizer, so LR schedulers work on it.
    ``step``, ``finish`` and ``before_checkpoint`` are collective where the strategy communicates.
    """

    def __init__(self, inner: torch.optim.Optimizer, *, kind: str, rules: Sequence[SyncRule],
                 comm: Collective, model: torch.nn.Module | None = None, meter: MemoryMeter | None = None) -> None:
        self.clock = comm.clock
        self.balancer = comm.weights
        # Not calling Optimizer.__init__: the inner optimizer owns param_groups and state
        # (the same choice as torch.distributed.optim.PostLocalSGDOptimizer).
        self.inner = inner
        self.kind = kind
        self.rules = list(rules)
        self.comm = comm
        self.model = model  # for its buffers, which no strategy here synchronises
        self.meter = meter  # the memory_* figures (train.memory_meter)
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.steps_done = 0
        self._metrics: dict[str, float] = {"bytes_sent": 0.0, "bytes_sent_total": 0.0}
        self._finished_at: int | None = None
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    @property
    def state(self):  # type: ignore[override]
        return self.inner.state

    def __repr__(self) -> str:
        return f"SyncOptimizer(kind={self.kind!r}, inner={self.inner!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add parameter groups to the optimizer before torchrelay's prepare(); "
                                  "the synchronised parameter set is fixed there")

    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """One local step plus whatever the strategy does at this step. Collective for ddp warm-up/syncs."""
        k = self.steps_done + 1
        self.clock.step_called()
        for rule in self.rules:
            rule.before_step(k)
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.steps_done = k
        divergence = None
        for rule in self.rules:
            d = rule.after_step(k)
            divergence = d if d is not None else divergence
        times = self.clock.step_ended()
        if self.balancer is not None:
            if divergence is not None:
                self.balancer.parameters_synced()
            self.balancer.after_step(k, times)
            self.clock.restart()  # a re-measurement is not the next step's compute
        self._record(divergence)
        return loss

    def _record(self, divergence: float | None) -> None:
        self._metrics = {"bytes_sent": float(self.comm.take_pending()),
                         "bytes_sent_total": float(self.comm.total_bytes)}
        times = self.clock.last
        if times is not None:
            self._metrics.update(compute_s=times.compute_s, allreduce_wait_s=times.idle_s,
                                 idle_fraction=times.idle_fraction)
        if self.balancer is not None:
            self._metrics.update(self.balancer.metrics())
        if divergence is not None:
            self._metrics["divergence"] = divergence

    def metrics(self) -> dict[str, float]:
        """This process's figures for the last step (see module doc). Does not communicate."""
        memory = self.meter.metrics() if self.meter is not None else {}
        return {**memory, **self._metrics}

    def close(self) -> None:
        if self.meter is not None:
            self.meter.close()

    @property
    def replicas_identical(self) -> bool:
        """True when every rank holds the same parameters now (ddp always; others after a sync)."""
        if self.kind == "ddp" or self.comm.world_size <= 1:
            return True
        return all(rule.synced_at == self.steps_done for rule in self.rules
                   if not isinstance(rule, GradientAverage))

    def per_replica_tensors(self) -> list[torch.Tensor]:
        """The tensors whose values differ between ranks now (live ones, not copies). Does not communicate.

        Empty for ddp (replicas equal after every step) and in a world of 1. Otherwise the inner
        optimizer's state (momentum, Adam moments: computed from local gradients) and the model's
        buffers (never averaged) always, and the synchronised parameters unless this step synced
        them. DiLoCo's global parameters and outer momentum are the same on every rank: not listed.
        """
        if self.kind == "ddp" or self.comm.world_size <= 1:
            return []
        out = [value for per_param in self.inner.state.values() for value in per_param.values()
               if isinstance(value, torch.Tensor)]
        if self.model is not None:
            out.extend(self.model.buffers())
        if not self.replicas_identical:
            out.extend(self.rules[0].params if self.rules else [])  # every rule holds the same list
        return out

    def before_checkpoint(self) -> None:
        """Collective for final_average (averages so the checkpoint is the consensus); no-op otherwise."""
        divergence = None
        for rule in self.rules:
            d = rule.on_checkpoint(self.steps_done)
            divergence = d if d is not None else divergence
        if divergence is not None:
            self._metrics["divergence"] = divergence

    def finish(self) -> None:
        """Average replicas not synchronised since the last step. Collective; idempotent."""
        if self._finished_at == self.steps_done:
            return
        self._finished_at = self.steps_done
        divergence = None
        for rule in self.rules:
            d = rule.on_finish(self.steps_done)
            divergence = d if d is not None else divergence
        if divergence is not None and self.balancer is not None:
            self.balancer.parameters_synced()
        self._metrics["bytes_sent_total"] = float(self.comm.total_bytes)
        if divergence is not None:
            self._metrics["divergence"] = divergence

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"inner": self.inner.state_dict(),
                "sync": {"kind": self.kind, "steps_done": self.steps_done,
                         "rules": [rule.state_dict() for rule in self.rules]}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore inner optimizer, step counter and rule state.

        A plain optimizer state dict (no ``sync`` entry) loads into the inner optimizer and
        starts the schedule at step 0; a checkpoint from another strategy keeps its step
        counter but not its rules' state (with a warning).
        """
        if "inner" not in state_dict:
            self.inner.load_state_dict(state_dict)
            self.steps_done = 0
            return
        self.inner.load_state_dict(state_dict["inner"])
        sync = state_dict.get("sync", {})
        self.steps_done = int(sync.get("steps_done", 0))
        rules = sync.get("rules", [])
        if sync.get("kind") == self.kind and len(rules) == len(self.rules):
            for rule, state in zip(self.rules, rules):
                rule.load_state_dict(state)
        else:
            warnings.warn(f"checkpoint was written under strategy {sync.get('kind')!r}, this job runs "
                          f"{self.kind!r}: keeping the step counter ({self.steps_done}), starting the "
                          "synchronisation state fresh", stacklevel=2)
            for rule in self.rules:
                rule.synced_at = self.steps_done
        self._finished_at = None


# ---------------------------------------------------------------- model transform


def _weighted_allreduce_hook(comm, bucket):
    # No annotations: DDP checks that ``bucket`` is annotated as the class dist.GradBucket,
    # and ``from __future__ import annotations`` would turn that into a string.
    # torch's allreduce_hook divides by the world and sums; this one multiplies by this rank's
    # weight (1 / world, or b_i / B when balanced) and sums: the same for equal shares, the
    # whole batch's gradient for uneven ones. It also counts the bytes and notes when the
    # gradients were ready (the last bucket's call), from which the clock tells the wait.
    buffer = bucket.buffer()
    comm.count(buffer.numel() * buffer.element_size())
    comm.clock.gradients_ready()
    weight = comm.weights.gradient_weight() if comm.weights is not None else 1.0 / comm.world_size
    buffer.mul_(weight)
    if comm.peer_sum is not None and bucket.is_last():
        # One exchange of the whole bucket instead of gloo's ring, which waits in two steps for both
        # ranks to be scheduled, its receive posted a step ahead (measured: docs/benchmarks.md, "#16:
        # the two-rank all-reduce as one exchange" and "#16: the receive posted a step ahead").
        # Only the last bucket: it blocks, and after it backward has nothing left to overlap.
        done = torch.futures.Future()
        done.set_result(comm.peer_sum(buffer))
        return done
    future = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def apply_ddp(model: torch.nn.Module, ctx: Context, comm: Collective) -> torch.nn.Module:
    """Wrap in ``DistributedDataParallel`` whose gradient all-reduce is weighted, counted and
    timed by ``comm``."""
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device(ctx.device)
    device_ids = [device] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    if comm.world_size == 2 and exchange.agreed(on_cpu=device.type == "cpu"):
        comm.peer_sum = exchange.PeerSum()
    ddp.register_comm_hook(comm, _weighted_allreduce_hook)
    if not any(group is dist.group.WORLD for group in _GROUPS_OUTLIVING_REDUCERS):
        _GROUPS_OUTLIVING_REDUCERS.append(dist.group.WORLD)
    return ddp


# DDP's reducer holds its process group. Were the reducer the group's last holder, freeing the
# user's model (when the script's training function returns, after ``shutdown``) would destroy
# the group inside the reducer's destructor, which joins gloo's threads with the GIL held; a gloo
# thread still releasing the hook's ``then`` callback needs the GIL, and the rank hangs for good
# (seen in about 1 of 40 runs of a 2-host × 2-rank job; pytorch#56297). A group released from
# Python drops the GIL while it joins (or, in a job's worker, is never destroyed: the worker
# ends with ``os._exit``), so the groups DDP uses are kept here until the process ends.
_GROUPS_OUTLIVING_REDUCERS: list[Any] = []


# ---------------------------------------------------------------- entry points


def _as_strategy(strategy: Any):
    if strategy is None:
        return DDPStrategy()
    if isinstance(strategy, dict):
        try:
            strategy = validate_strategy(strategy)
        except ValidationError as exc:
            raise InvalidSpec(describe_validation_error(exc).replace("spec", "strategy", 1)) from None
    if not isinstance(strategy, (DDPStrategy, LocalSGDStrategy, DiLoCoStrategy, FinalAverageStrategy)):
        kind = getattr(strategy, "kind", type(strategy).__name__)
        raise InvalidSpec(f"strategy kind {kind!r} is not a synchronisation strategy; "
                          f"torchrelay.train.sync handles {', '.join(SYNC_KINDS)}")
    return strategy


def build_rules(strategy: Any, params: Sequence[torch.Tensor], comm: Collective) -> list[SyncRule]:
    """The rules that make up ``strategy`` (pure construction; no communication)."""
    if isinstance(strategy, DDPStrategy):
        return []
    if isinstance(strategy, LocalSGDStrategy):
        schedule = PeriodicSchedule(every=strategy.every, warmup_steps=strategy.warmup_steps)
        rules: list[SyncRule] = []
        if strategy.warmup_steps:
            rules.append(GradientAverage(params, comm, until_step=strategy.warmup_steps))
        rules.append(ParameterAverage(params, comm, schedule=schedule))
        return rules
    if isinstance(strategy, DiLoCoStrategy):
        return [DiLoCoOuter(params, comm, every=strategy.every, outer_lr=strategy.outer_lr,
                            outer_momentum=strategy.outer_momentum)]
    if isinstance(strategy, FinalAverageStrategy):
        return [FinalAverage(params, comm)]
    raise AssertionError(f"unhandled strategy {strategy!r}")


def _check_context(ctx: Context) -> None:
    world, rank = getattr(ctx, "world_size", None), getattr(ctx, "rank", None)
    if not isinstance(world, int) or world < 1:
        raise InvalidSpec(f"ctx.world_size={world!r} must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise InvalidSpec(f"ctx.rank={rank!r} must be an integer in [0, {world})")
    if world > 1 and not dist.is_initialized():
        raise RuntimeError(f"world_size={world} needs torch.distributed's default process group; "
                           "call torch.distributed.init_process_group (torchrelay.train.init does) first")
    if dist.is_initialized() and dist.get_world_size() != world:
        raise InvalidSpec(f"ctx.world_size={world} but the default process group has "
                          f"{dist.get_world_size()} ranks; they must agree")


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Any,
            ctx: Context) -> tuple[torch.nn.Module, SyncOptimizer]:
    """Apply ``strategy`` to ``model`` and ``optimizer``. Collective (broadcasts rank 0's parameters).

    Moves the model to ``ctx.device``. Returns the model (wrapped in DDP for ``ddp`` when a
    process group exists, else the same object) and a ``SyncOptimizer`` over ``optimizer``. Raises ``InvalidSpec`` for a strategy
    that is not a synchronisation strategy or a context that does not fit the process group.
    """
    strategy = _as_strategy(strategy)
    _check_context(ctx)
    balancer = balancer_for(strategy, ctx.rank, ctx.world_size)
    comm = Collective(ctx.world_size, clock=StepClock(overlapped=isinstance(strategy, DDPStrategy)),
                      weights=balancer)
    model = model.to(ctx.device)  # in place for parameters, so the optimizer still holds them
    params = [p for p in model.parameters() if p.requires_grad]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [i for i, p in enumerate(params) if id(p) not in optimized]
    if missing and not isinstance(strategy, DDPStrategy):
        raise InvalidSpec(f"{len(missing)} trainable parameters of the model (indices {missing[:5]}) are "
                          "not in the optimizer; pass an optimizer over model.parameters()")
    if balancer is not None and dist.is_initialized():
        # the first split before any step is measured: a CPU rank under a 0.5-cpu quota beside
        # one of 1 cpu starts at a third of the batch, not half (a GPU rank's speed is unknown: even)
        balancer.agree_prior(cpu_allowance() if torch.device(ctx.device).type == "cpu" else 0.0)
    if isinstance(strategy, DDPStrategy):
        if dist.is_initialized():
            model = apply_ddp(model, ctx, comm)  # DDP broadcasts rank 0's state itself
    else:
        comm.broadcast_([p.data for p in params], counted=False)
    rules = build_rules(strategy, params, comm)
    meter = MemoryMeter(model, optimizer)
    return model, SyncOptimizer(optimizer, kind=strategy.kind, rules=rules, comm=comm, model=model, meter=meter)


def finish(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """End of training: make replicas equal where the strategy left them apart. Collective; idempotent.

    A no-op for an optimizer that ``prepare`` did not wrap, and for ddp.
    """
    del model  # the parameters are the optimizer's; kept in the signature for symmetry with prepare
    if isinstance(optimizer, SyncOptimizer):
        optimizer.finish()
