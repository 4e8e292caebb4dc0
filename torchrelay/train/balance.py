"""Balanced data parallel in a worker: the shares in force, their re-measurement, the loader
that follows them; and every data-parallel step's clock (compute, idle in collectives).

Contract:
- ``StepClock`` times one rank's steps for every data-parallel strategy, balanced or not.
  ``gradients_ready()`` (DDP's comm hook, per bucket: the last call is when backward produced
  the last gradients), ``in_collective()`` (a context around a blocking collective),
  ``step_called()``/``step_ended()`` (the prepared optimizer's ``step``). A step runs from the
  end of the previous one; its ``compute_s`` until its gradients were ready (DDP) or until
  ``step`` was called, its ``idle_s`` waiting for the all-reduce after that (DDP) or inside the
  blocking collectives (local SGD, DiLoCo). ``busy_s`` is the step less that wait: its
  compute and its optimizer step, what this rank itself adds to the step. The first step has
  no start: no figures.
- ``Balancer`` (one per process, ``session.balancer``, made by ``balancer_for``): the shares of
  the global batch ``B`` (``set_global_batch``: the first split until calibrated: in proportion
  to every rank's CPU allowance when ``agree_prior`` found that all ranks are CPU ranks, which
  ``prepare`` calls, else even; calibration compares a split from allowances as a move's
  refinement, below, and the window after it refines it again), the batch being
  trained (``on_batch(mine, total)``, called by the loader), the weights a rank's gradient
  (``mine / total``) and its parameters (its samples since the last parameter sync over
  everyone's) carry, and ``after_step(step, times)`` (the step's ``StepTimes``): after the
  calibration steps and every ``balance_every`` steps (K/2 for a refinement, below; on the grid
  calibration + n × K again after ``load_state_dict``), every rank's samples/s over the window
  (its samples over its ``busy_s``: the optimizer step, slower on a slower rank, delays that
  rank's next arrival at the all-reduce as its compute does) is all-reduced, rank 0 decides
  (``shares.decide_resplit``: its thresholds are the hysteresis, and ``SpeedBands`` tells it when
  a rank's speed left its own spread for good; the window after a move made from a window
  (calibration's, or a changed speed's), half as long as the others, refines it with half the
  threshold (a quarter when it carries the move on), because that window was measured at the
  old shares and a rank's samples/s grows with its share, a step's fixed costs spread over more
  samples; a refinement is not refined again; once, before any rank changed speed, speeds
  steady over several windows may move it by a quarter of the threshold,
  ``shares.fine_resplit``) and broadcasts the shares, which the next batch uses, and whether
  they are the fine move (so every rank knows when the next comparison is due). Collective at
  those steps (every rank
  calls ``after_step`` at every step: the prepared optimizer does).
  ``state_dict``/``load_state_dict``: shares, global batch, the re-split count (``TrainState``
  saves them, so a resumed job continues with the same split; the speed windows are not saved:
  a resumed job may run on other nodes, and may make the fine move once more).
- ``BalancedLoader`` (``train.shard`` under ``balance: throughput``): the batches of this rank,
  ``shares.step_split`` of an epoch's order (a permutation from ``seed + epoch``, as
  ``DistributedSampler`` draws it), read at each step so that a re-split applies to the next
  batch. ``len`` is the steps of an epoch; ``set_epoch`` (also as ``loader.sampler.set_epoch``).
  Index-level and in-memory: a ``TensorDataset`` is indexed as tensors, anything else item by
  item through ``collate_fn`` (torch's default).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset, default_collate

from torchrelay.train import shares as S
from torchrelay.train.session import current_session
from torchrelay.train.speed_bands import SpeedBands

CALIBRATION_STEPS = 3

__all__ = ["BalancedLoader", "Balancer", "StepClock", "StepTimes", "balancer_for"]


@dataclass(frozen=True, slots=True)
class StepTimes:
    compute_s: float
    idle_s: float
    step_s: float

    @property
    def busy_s(self) -> float:
        """The step less the wait: this rank's compute and optimizer step."""
        return self.step_s - self.idle_s

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.step_s if self.step_s > 0 else 0.0


class StepClock:
    """One rank's step times (see the module docstring)."""

    def __init__(self, *, overlapped: bool, now: Callable[[], float] = time.perf_counter) -> None:
        self.overlapped = overlapped  # DDP: the all-reduce overlaps backward, waited for at its end
        self._now = now
        self._start: float | None = None
        self._ready: float | None = None
        self._called: float | None = None
        self._collective_s = 0.0
        self.last: StepTimes | None = None

    def gradients_ready(self) -> None:
        self._ready = self._now()

    @contextlib.contextmanager
    def in_collective(self) -> Iterator[None]:
        began = self._now()
        try:
            yield
        finally:
            self._collective_s += self._now() - began

    def restart(self) -> None:
        """The next step starts now (after work that belongs to neither step)."""
        self._start = self._now()

    def step_called(self) -> None:
        self._called = self._now()

    def step_ended(self) -> StepTimes | None:
        """This step's times (None for the first step, which has no start)."""
        now = self._now()
        start, self._start = self._start, now
        called = self._called if self._called is not None else now
        ready = self._ready if (self.overlapped and self._ready is not None) else called
        collective_s, self._collective_s, self._ready = self._collective_s, 0.0, None
        if start is None:
            self.last = None
            return None
        ready = max(start, min(ready, called))
        idle = (called - ready) if self.overlapped else 0.0
        self.last = StepTimes(compute_s=ready - start, idle_s=idle + collective_s, step_s=now - start)
        return self.last


class Balancer:
    """The shares of one job's global batch (see the module docstring)."""

    def __init__(self, *, rank: int, world: int, every: int, threshold: float,
                 calibration_steps: int = CALIBRATION_STEPS) -> None:
        self.rank, self.world = rank, world
        self.every, self.threshold, self.calibration_steps = every, threshold, calibration_steps
        self.global_batch: int | None = None
        self.shares: tuple[int, ...] | None = None
        self.resplits = 0
        self.speeds: tuple[float, ...] | None = None  # samples/s of every rank, last measured
        self.current = (0, 0)  # (this rank's samples, everyone's) of the batch being trained
        self._window = [0, 0.0]  # this rank's samples and busy seconds since the last measurement
        self._since_sync = [0, 0]  # this rank's samples and everyone's since the last parameter sync
        self._pending: tuple[int, ...] | None = None  # rank 0: a drift awaiting confirmation
        self._bands = SpeedBands(floor=threshold)  # rank 0: has a rank's speed really changed?
        self._refining = False  # the next comparison is the first after a move made from a window (every rank)
        self._moved_from: tuple[int, ...] | None = None  # rank 0: the shares before that move
        self._last_measured: int | None = None  # the step of the last comparison (None: none yet, or resumed)
        self._fine_due = True  # rank 0: the fine move may still come (not yet made, no speed changed)
        self._prior: tuple[float, ...] | None = None  # every rank's CPU allowance, when all are CPU ranks
        self._first_split = False  # the shares are the first split, from the prior: nothing measured or loaded

    def agree_prior(self, allowance: float) -> tuple[float, ...] | None:
        """Every rank's ``allowance`` (its CPUs: ``cpu_allowance.cpu_allowance()``; 0 for a rank
        that is not on the CPU), all-reduced: collective. When every rank gave one, they are the
        weights of the first split, which the shares take at once if they are still the first
        split (nothing measured or loaded); with a 0 anywhere, an even split. Returns the weights
        in force (None: even)."""
        allowances = torch.zeros(self.world, dtype=torch.float64)
        allowances[self.rank] = max(0.0, float(allowance))
        if self.world > 1:
            dist.all_reduce(allowances)
        self._prior = tuple(float(a) for a in allowances) if all(a > 0 for a in allowances) else None
        if self._first_split and self.global_batch is not None:
            self.shares = self._first_shares(self.global_batch)
        return self._prior

    def _first_shares(self, global_batch: int) -> tuple[int, ...]:
        return S.proportional_shares(list(self._prior or [1.0] * self.world), global_batch)

    def set_global_batch(self, global_batch: int) -> None:
        """The global batch ``B``; the first split (``agree_prior``'s weights, else even) unless
        shares for this ``B`` are known."""
        if self.shares is None or sum(self.shares) != global_batch:
            self.shares = self._first_shares(global_batch)
            self._first_split = True
            self._bands.reset()
        self.global_batch = global_batch

    @property
    def share(self) -> int:
        return self.shares[self.rank] if self.shares else 0

    def on_batch(self, mine: int, total: int) -> None:
        self.current = (mine, total)
        self._since_sync[0] += mine
        self._since_sync[1] += total

    def gradient_weight(self) -> float:
        mine, total = self.current
        return mine / total if total else 1.0 / self.world

    def parameter_weight(self) -> float:
        mine, total = self._since_sync
        return mine / total if total else 1.0 / self.world

    def parameters_synced(self) -> None:
        self._since_sync = [0, 0]

    def after_step(self, step: int, times: StepTimes | None) -> bool:
        """Count the step (``times``: its clock, None when unknown; its ``busy_s`` is what this
        rank's speed is measured over); re-measure and maybe re-split when due (collective then).
        True when the shares changed."""
        if times is not None:
            self._window[0] += self.current[0]
            self._window[1] += times.busy_s
        if self.shares is None or not S.remeasure_due(step, self.every, self.calibration_steps, self._last_measured,
                                                      self._refining):
            return False
        self._last_measured = step
        mine = self._window[0] / self._window[1] if self._window[1] > 0 else 0.0
        self._window = [0, 0.0]
        speeds = torch.zeros(self.world, dtype=torch.float64)
        speeds[self.rank] = mine
        if self.world > 1:
            dist.all_reduce(speeds)
        self.speeds = tuple(float(x) for x in speeds)
        new, fine = None, False
        # an uneven first split is the allowances' guess, as if moved from an even one: calibration
        # compares it as a refinement, and whether or not that moves it, the window after (K/2) is
        # a refinement too, so a guess is measured over a whole half window before it is kept
        # (equal allowances give the even split, which calibration compares as it always did)
        even = S.proportional_shares([1.0] * self.world, sum(self.shares))
        guessed = self._first_split and self.shares != even
        if self.rank == 0:
            speed_changed = self._bands.observe(self.speeds)
            refining = even if guessed else self._moved_from if self._refining else None
            outcome = S.decide_resplit(self.shares, self.speeds, self.threshold, self._pending, speed_changed,
                                       refining=refining)
            new, self._pending = outcome.shares, outcome.pending
            if new is not None and new != self.shares:
                if step > self.calibration_steps and not self._refining:
                    self._fine_due = False  # a worker changed speed: this split comes from a whole window
            elif self._pending is None and self._fine_due and (steady := self._bands.steady_speeds()):
                new = S.fine_resplit(self.shares, steady, self.threshold)
                fine = new is not None
                self._fine_due = not fine
            if new is not None and new != self.shares and not fine:
                self._bands.reset()  # a fine move's sample or two leaves every rank's speed comparable
        # the shares, and whether they are a fine move: every rank keeps the same schedule of comparisons
        decided = torch.tensor([*(new if new is not None else self.shares), int(fine)], dtype=torch.int64)
        if self.world > 1:
            dist.broadcast(decided, src=0)
        shares, fine = tuple(int(x) for x in decided[:-1]), bool(decided[-1])
        changed = shares != self.shares
        self._first_split = False
        self._moved_from = even if guessed and not changed else self.shares
        self.shares = shares
        self.resplits += changed
        # a move made from a window is refined by the next one (measured at the new shares), once
        self._refining = (changed and not fine and not self._refining) or guessed
        return changed

    def metrics(self) -> dict[str, float]:
        out = {"share": float(self.share), "resplits": float(self.resplits)}
        if self.speeds is not None:
            out["measured_samples_per_s"] = self.speeds[self.rank]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"shares": list(self.shares or ()), "global_batch": self.global_batch or 0,
                "resplits": self.resplits, "world": self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Shares of a checkpoint of the same world and global batch (else kept: re-measured)."""
        shares = tuple(int(x) for x in state.get("shares", ()))
        if len(shares) == self.world and shares and (self.global_batch in (None, sum(shares))):
            self.shares, self.global_batch = shares, sum(shares)
            self._first_split = False
        self.resplits = int(state.get("resplits", 0))
        self._last_measured, self._refining, self._window = None, False, [0, 0.0]  # re-measured from the grid


def balancer_for(strategy: Any, rank: int, world: int) -> Balancer | None:
    """The session's balancer for ``strategy`` (None unless it asks for ``balance: throughput``)."""
    if getattr(strategy, "balance", "none") != "throughput" or world < 2:
        return None
    session = current_session()
    if session.balancer is None or (session.balancer.rank, session.balancer.world) != (rank, world):
        session.balancer = Balancer(rank=rank, world=world, every=strategy.balance_every,
                                    threshold=strategy.balance_threshold)
    return session.balancer


class BalancedLoader:
    """This rank's batches under balanced shares (see the module docstring)."""

    def __init__(self, dataset: Any, *, batch_size: int, balancer: Balancer, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.balancer = balancer
        self.global_batch = batch_size * balancer.world
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.collate_fn = collate_fn or default_collate
        self.epoch = 0
        balancer.set_global_batch(self.global_batch)
        self._steps = S.steps_per_epoch(len(dataset), self.global_batch, balancer.world, drop_last)

    @property
    def sampler(self) -> BalancedLoader:
        return self  # ``loader.sampler.set_epoch(e)`` as with a DistributedSampler

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self._steps

    def order(self) -> list[int]:
        """The epoch's order of sample indices (``DistributedSampler``'s rule: seed + epoch)."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def indices(self, step: int, order: list[int]) -> list[int]:
        """This rank's sample indices at ``step`` of the epoch, with the shares now in force."""
        balancer = self.balancer
        split = S.step_split(len(self.dataset), self.global_batch, step, balancer.shares, self.drop_last)
        start, stop = split[balancer.rank]
        balancer.on_batch(stop - start, split[-1][1] - split[0][0])
        return order[start:stop]

    def __iter__(self) -> Iterator[Any]:
        order = self.order()
        for step in range(self._steps):
            idx = self.indices(step, order)
            if isinstance(self.dataset, TensorDataset):
                index = torch.tensor(idx, dtype=torch.long)
                yield tuple(t[index] for t in self.dataset.tensors)
            else:
                yield self.collate_fn([self.dataset[i] for i in idx])
