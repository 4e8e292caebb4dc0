"""Pipeline partitioner: per-block costs in, contiguous stage assignment out. Pure, no I/O.

Contract:
- ``plan_stages(blocks, devices, link=Link(), microbatches=8, schedule="1f1b")`` cuts the
  ordered ``blocks`` into ``len(devices)`` contiguous, non-empty stages, stage ``k`` running on
  ``devices[k]``, and returns the ``Plan`` whose slowest stage is the fastest possible (exact,
  by dynamic programming over (stage, first block) in O(stages × blocks²) with numpy rows).
  Among the plans with that optimum it takes one with the least summed stage time, which is
  what fill and drain of the pipeline cost.
- A stage's time per micro-batch is its blocks' forward+backward time on its device, plus the
  time to move, over ``link``, the activation in and its gradient back across each of its cuts
  (both neighbours of a cut pay for it: with one thread per stage neither computes while the
  bytes move).
- A stage's memory is its blocks' parameter+gradient+optimizer bytes plus the activations it
  keeps for backward times the micro-batches in flight on it (GPipe: all ``microbatches``;
  1F1B: ``stages - k`` on stage ``k``, at most ``microbatches``). A stage above its device's
  cap is never chosen; if every cut breaks a cap, ``PlanInfeasible`` names the numbers.
- ``Plan.describe()`` is the text ``relay status`` shows; ``Plan.to_dict()`` the same as JSON.
- ``exhaustive_plan`` tries every contiguous cut: the reference the tests compare against.
- ``near_optimal_cuts`` lists a plan's neighbouring cuts predicted within a tolerance of it,
  which ``prepare`` then measures as whole stages (api.py).
- ``sharded_costs(blocks, shards)``: the costs as each rank of a stage sharded over ``shards``
  replicas (``data_parallel: fsdp``) sees them (parameter, gradient and optimizer bytes divided
  by ``shards``; time and activations unchanged), and the bytes to hold back from every
  device's cap for the one block gathered whole at a time (the largest block's bytes, all of
  them: on the safe side).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Literal, Sequence

import numpy as np

from torchrelay.errors import InvalidSpec, Unschedulable

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class PlanInfeasible(Unschedulable):
    """No contiguous cut of the blocks fits the devices' memory caps."""


@dataclass(frozen=True, slots=True)
class BlockCost:
    """What one block costs per micro-batch on a device of speed 1.0.

    ``time_s``: forward+backward seconds. ``out_bytes``: the activation it hands to the next
    block (its gradient comes back with the same size). ``param_bytes``: parameters, their
    gradients and optimizer state. ``stash_bytes``: activations autograd keeps for backward.
    """

    time_s: float
    out_bytes: int = 0
    param_bytes: int = 0
    stash_bytes: int = 0
    name: str = ""


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A device a stage runs on: ``speed`` 2.0 runs blocks in half the time of 1.0;
    ``mem_cap_bytes`` None means no cap. ``block_times_s`` (optional) replaces
    ``BlockCost.time_s / speed`` with times measured on this very device, one per block."""

    name: str = "cpu"
    speed: float = 1.0
    mem_cap_bytes: int | None = None
    block_times_s: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Link:
    """The link between neighbouring stages: bytes per second and seconds per message."""

    bandwidth_bytes_per_s: float = math.inf
    latency_s: float = 0.0

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage: blocks ``[first, stop)`` on ``device``, with its predicted costs."""

    index: int
    device: str
    first: int
    stop: int
    compute_s: float
    comm_s: float
    mem_bytes: int
    mem_cap_bytes: int | None
    block_names: tuple[str, ...] = ()

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def blocks(self) -> range:
        return range(self.first, self.stop)


@dataclass(frozen=True, slots=True)
class Plan:
    """A contiguous cut of the blocks into stages, and why it was chosen."""

    stages: tuple[StagePlan, ...]
    microbatches: int
    schedule: str
    num_blocks: int
    equal_split_bottleneck_s: float | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's time per micro-batch: the pipeline's steady-state period."""
        return max(s.time_s for s in self.stages)

    @property
    def predicted_step_s(self) -> float:
        """Step time of a fill-steady-drain schedule: (M-1) × slowest stage + Σ stages."""
        return (self.microbatches - 1) * self.bottleneck_s + sum(s.time_s for s in self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """First block of each stage, e.g. (0, 3, 7)."""
        return tuple(s.first for s in self.stages)

    def stage_of_block(self, block: int) -> int:
        for stage in self.stages:
            if stage.first <= block < stage.stop:
                return stage.index
        raise InvalidSpec(f"block {block} is not in this plan of {self.num_blocks} blocks")

    def to_dict(self) -> dict:
        """JSON-ready form (what ``relay status`` prints with ``-o json``)."""
        return {
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "num_blocks": self.num_blocks,
            "bottleneck_s": self.bottleneck_s,
            "predicted_step_s": self.predicted_step_s,
            "equal_split_bottleneck_s": self.equal_split_bottleneck_s,
            "stages": [
                {
                    "stage": s.index, "device": s.device, "blocks": [s.first, s.stop],
                    "block_names": list(s.block_names), "time_s": s.time_s,
                    "compute_s": s.compute_s, "comm_s": s.comm_s, "mem_bytes": s.mem_bytes,
                    "mem_cap_bytes": s.mem_cap_bytes,
                }
                for s in self.stages
            ],
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        """Human-readable table of the plan (what ``relay status`` shows)."""
        lines = [f"pipeline plan: {len(self.stages)} stages, {self.num_blocks} blocks, "
                 f"{self.microbatches} micro-batches, schedule {self.schedule}"]
        slowest = max(self.stages, key=lambda s: s.time_s).index
        for s in self.stages:
            cap = "no cap" if s.mem_cap_bytes is None else f"cap {_mib(s.mem_cap_bytes)}"
            names = f" ({s.block_names[0]}..{s.block_names[-1]})" if s.block_names else ""
            mark = "  <- slowest" if s.index == slowest else ""
            lines.append(
                f"  stage {s.index} on {s.device}: blocks {s.first}-{s.stop - 1}{names}  "
                f"{s.time_s * 1e3:.3f} ms/mb (compute {s.compute_s * 1e3:.3f} + comm "
                f"{s.comm_s * 1e3:.3f})  mem {_mib(s.mem_bytes)} / {cap}{mark}")
        lines.append(f"  predicted step {self.predicted_step_s * 1e3:.2f} ms "
                     f"(slowest stage {self.bottleneck_s * 1e3:.3f} ms per micro-batch)")
        if self.equal_split_bottleneck_s is not None:
            lines.append(f"  equal-layer split would have its slowest stage at "
                         f"{self.equal_split_bottleneck_s * 1e3:.3f} ms")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f}MiB"


# ---------------------------------------------------------------- the cost tables


class _Costs:
    """Prefix sums so that any stage's time and memory is O(1) (vectorised over first block)."""

    def __init__(self, blocks: Sequence[BlockCost], devices: Sequence[DeviceSpec], link: Link,
                 microbatches: int, schedule: str):
        _validate(blocks, devices, link, microbatches, schedule)
        self.n, self.num_stages = len(blocks), len(devices)
        self.blocks, self.devices = blocks, devices
        zero = np.zeros(1)
        self.time_prefix = []
        for device in devices:
            if device.block_times_s is not None:
                times = np.asarray(device.block_times_s, dtype=float)
            else:
                times = np.array([b.time_s for b in blocks], dtype=float) / device.speed
            self.time_prefix.append(np.concatenate([zero, np.cumsum(times)]))
        self.param_prefix = np.concatenate([zero, np.cumsum([b.param_bytes for b in blocks])])
        self.stash_prefix = np.concatenate([zero, np.cumsum([b.stash_bytes for b in blocks])])
        # cut_s[c]: moving activation and gradient across the cut before block c (c in 1..n-1)
        self.cut_s = np.array([0.0] + [2 * link.transfer_s(b.out_bytes) for b in blocks[:-1]]
                              + [0.0])
        self.in_flight = [microbatches if schedule == "gpipe"
                          else min(self.num_stages - k, microbatches)
                          for k in range(self.num_stages)]

    def time(self, k: int, first: np.ndarray | int, stop: int) -> np.ndarray:
        tp = self.time_prefix[k]
        return tp[stop] - tp[first] + self.cut_s[first] + self.cut_s[stop]

    def compute(self, k: int, first: int, stop: int) -> float:
        return float(self.time_prefix[k][stop] - self.time_prefix[k][first])

    def mem(self, k: int, first: np.ndarray | int, stop: int) -> np.ndarray:
        return (self.param_prefix[stop] - self.param_prefix[first]
                + self.in_flight[k] * (self.stash_prefix[stop] - self.stash_prefix[first]))

    def fits(self, k: int, first: np.ndarray | int, stop: int) -> np.ndarray:
        cap = self.devices[k].mem_cap_bytes
        if cap is None:
            return np.ones_like(np.atleast_1d(first), dtype=bool)
        return np.atleast_1d(self.mem(k, first, stop) <= cap)

    def stage(self, k: int, first: int, stop: int) -> StagePlan:
        return StagePlan(
            index=k, device=self.devices[k].name, first=first, stop=stop,
            compute_s=self.compute(k, first, stop),
            comm_s=float(self.cut_s[first] + self.cut_s[stop]),
            mem_bytes=int(self.mem(k, first, stop)),
            mem_cap_bytes=self.devices[k].mem_cap_bytes,
            block_names=tuple(b.name for b in self.blocks[first:stop]) if any(
                b.name for b in self.blocks) else (),
        )


def _validate(blocks, devices, link, microbatches, schedule) -> None:
    if not blocks:
        raise InvalidSpec("pipeline: no blocks to partition; give at least one block")
    if not devices:
        raise InvalidSpec("pipeline: no devices to place stages on; give at least one")
    if len(devices) > len(blocks):
        raise InvalidSpec(f"pipeline: {len(devices)} stages for {len(blocks)} blocks; "
                          f"use at most {len(blocks)} stages (each stage needs a block)")
    if schedule not in SCHEDULES:
        raise InvalidSpec(f"pipeline: schedule {schedule!r} is not one of {SCHEDULES}")
    if microbatches < 1:
        raise InvalidSpec(f"pipeline: microbatches={microbatches}; use 1 or more")
    if not link.bandwidth_bytes_per_s > 0 or link.latency_s < 0:
        raise InvalidSpec(f"pipeline: link {link} needs bandwidth > 0 and latency >= 0")
    for i, b in enumerate(blocks):
        if not (b.time_s >= 0 and math.isfinite(b.time_s)) or min(
                b.out_bytes, b.param_bytes, b.stash_bytes) < 0:
            raise InvalidSpec(f"pipeline: block {i} {b} has a negative or non-finite cost")
    for k, d in enumerate(devices):
        if not d.speed > 0 or not math.isfinite(d.speed):
            raise InvalidSpec(f"pipeline: device {k} ({d.name}) speed {d.speed}; use > 0")
        if d.mem_cap_bytes is not None and d.mem_cap_bytes < 0:
            raise InvalidSpec(f"pipeline: device {k} ({d.name}) memory cap {d.mem_cap_bytes}")
        if d.block_times_s is not None and len(d.block_times_s) != len(blocks):
            raise InvalidSpec(f"pipeline: device {k} ({d.name}) has {len(d.block_times_s)} "
                              f"block times for {len(blocks)} blocks")


# ---------------------------------------------------------------- planning


def plan_stages(blocks: Sequence[BlockCost], devices: Sequence[DeviceSpec],
                link: Link = Link(), microbatches: int = 8,
                schedule: Schedule = "1f1b") -> Plan:
    """The contiguous cut of ``blocks`` over ``devices`` with the fastest slowest stage.

    Exact. Raises ``PlanInfeasible`` (naming stage memory against caps) when no cut fits,
    ``InvalidSpec`` for malformed input (more stages than blocks, negative costs, ...).
    """
    costs = _Costs(blocks, devices, link, microbatches, schedule)
    bottleneck = _min_bottleneck(costs)
    if not math.isfinite(bottleneck):
        raise PlanInfeasible(_infeasible_message(costs))
    # Second pass: least summed stage time among cuts whose every stage is within the optimum.
    limit = bottleneck * (1 + 1e-9) + 1e-15
    boundaries = _min_sum_within(costs, limit)
    stages = tuple(costs.stage(k, boundaries[k], boundaries[k + 1])
                   for k in range(costs.num_stages))
    equal = equal_split(len(blocks), len(devices))
    equal_bottleneck = max(float(costs.time(k, equal[k], equal[k + 1]))
                           for k in range(costs.num_stages))
    return Plan(stages=stages, microbatches=microbatches, schedule=schedule,
                num_blocks=len(blocks), equal_split_bottleneck_s=equal_bottleneck)


def _min_bottleneck(costs: _Costs) -> float:
    n, num_stages = costs.n, costs.num_stages
    # best[j]: fastest slowest stage for blocks [0, j) on the stages placed so far
    best = np.full(n + 1, math.inf)
    for stop in range(1, n + 1):
        if costs.fits(0, 0, stop)[0]:
            best[stop] = costs.time(0, 0, stop)
    for k in range(1, num_stages):
        nxt = np.full(n + 1, math.inf)
        for stop in range(k + 1, n + 1):
            firsts = np.arange(k, stop)
            cand = np.maximum(best[firsts], costs.time(k, firsts, stop))
            cand[~costs.fits(k, firsts, stop)] = math.inf
            nxt[stop] = cand.min()
        best = nxt
    return float(best[n])


def _min_sum_within(costs: _Costs, limit: float) -> list[int]:
    n, num_stages = costs.n, costs.num_stages
    total = np.full((num_stages, n + 1), math.inf)
    choice = np.zeros((num_stages, n + 1), dtype=int)
    for stop in range(1, n + 1):
        t = float(costs.time(0, 0, stop))
        if t <= limit and costs.fits(0, 0, stop)[0]:
            total[0, stop] = t
    for k in range(1, num_stages):
        for stop in range(k + 1, n + 1):
            firsts = np.arange(k, stop)
            t = costs.time(k, firsts, stop)
            cand = total[k - 1, firsts] + t
            cand[(t > limit) | ~costs.fits(k, firsts, stop)] = math.inf
            at = int(np.argmin(cand))
            total[k, stop], choice[k, stop] = cand[at], firsts[at]
    boundaries = [n]
    for k in range(num_stages - 1, 0, -1):
        boundaries.append(int(choice[k, boundaries[-1]]))
    boundaries.append(0)
    return boundaries[::-1]


def _infeasible_message(costs: _Costs) -> str:
    caps = [d.mem_cap_bytes for d in costs.devices]
    total_params = float(costs.param_prefix[-1])
    biggest = max(range(costs.n), key=lambda i: costs.blocks[i].param_bytes
                  + costs.blocks[i].stash_bytes)
    b = costs.blocks[biggest]
    cap_text = ", ".join("none" if c is None else _mib(c) for c in caps)
    return (f"pipeline: no cut of {costs.n} blocks into {costs.num_stages} stages fits the "
            f"memory caps [{cap_text}]: parameters+optimizer total {_mib(total_params)}, "
            f"activations kept for backward {_mib(float(costs.stash_prefix[-1]))} per "
            f"micro-batch (× micro-batches in flight: {costs.in_flight}); the largest block "
            f"{biggest}{' ' + b.name if b.name else ''} alone needs "
            f"{_mib(b.param_bytes)} + {_mib(b.stash_bytes)} per micro-batch. Use more stages, "
            f"devices with more memory, fewer micro-batches or the 1f1b schedule.")


def sharded_costs(blocks: Sequence[BlockCost], shards: int) -> tuple[list[BlockCost], int]:
    """(``blocks`` with parameter bytes per rank under sharding over ``shards``, bytes to hold back from
    each cap); see the module docstring."""
    if shards <= 1:
        return list(blocks), 0
    reserve = max((b.param_bytes for b in blocks), default=0)
    return [replace(b, param_bytes=-(-b.param_bytes // shards)) for b in blocks], reserve


def equal_split(num_blocks: int, num_stages: int) -> list[int]:
    """Boundaries of the equal-layer split (the first stages get the extra blocks)."""
    if not 1 <= num_stages <= num_blocks:
        raise InvalidSpec(f"pipeline: cannot split {num_blocks} blocks into {num_stages} stages")
    base, extra = divmod(num_blocks, num_stages)
    bounds = [0]
    for k in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def plan_from_boundaries(blocks: Sequence[BlockCost], devices: Sequence[DeviceSpec],
                         boundaries: Sequence[int], link: Link = Link(),
                         microbatches: int = 8, schedule: Schedule = "1f1b") -> Plan:
    """The ``Plan`` of a given cut (first block of each stage, then ``len(blocks)``).

    Memory caps are reported, not enforced, so a hand-made or equal split can be compared.
    """
    costs = _Costs(blocks, devices, link, microbatches, schedule)
    bounds = list(boundaries)
    if (len(bounds) != costs.num_stages + 1 or bounds[0] != 0 or bounds[-1] != costs.n
            or any(a >= b for a, b in zip(bounds, bounds[1:]))):
        raise InvalidSpec(f"pipeline: boundaries {bounds} must rise strictly from 0 to "
                          f"{costs.n} with {costs.num_stages + 1} entries")
    stages = tuple(costs.stage(k, bounds[k], bounds[k + 1]) for k in range(costs.num_stages))
    return Plan(stages=stages, microbatches=microbatches, schedule=schedule, num_blocks=costs.n)


def near_optimal_cuts(blocks: Sequence[BlockCost], devices: Sequence[DeviceSpec], plan: Plan,
                      link: Link = Link(), microbatches: int = 8, schedule: Schedule = "1f1b",
                      tolerance: float = 0.06, limit: int = 4) -> list[list[int]]:
    """The cuts worth measuring before trusting ``plan`` (boundary lists, ``len(blocks)``
    last): ``plan``'s own first, then those one block away from it (one boundary moved by
    one) whose predicted slowest stage is within ``tolerance`` of ``plan``'s and whose stages
    fit their memory caps, fastest predicted first; at most ``limit``. Pure.

    Why: a block's profile is taken in a window of about one stage, not as the stage that
    will run it; a stage of many blocks ran 2–8% slower than the sum of their profiles on
    the bench's transformer, enough to swap two cuts predicted within a few percent."""
    own = [*plan.boundaries, plan.num_blocks]
    scored = []
    for k in range(1, len(own) - 1):
        for step in (-1, 1):
            bounds = list(own)
            bounds[k] += step
            if any(a >= b for a, b in zip(bounds, bounds[1:])):
                continue
            other = plan_from_boundaries(blocks, devices, bounds, link, microbatches, schedule)
            if any(st.mem_cap_bytes is not None and st.mem_bytes > st.mem_cap_bytes
                   for st in other.stages):
                continue
            if other.bottleneck_s <= plan.bottleneck_s * (1 + tolerance):
                scored.append((other.bottleneck_s, bounds))
    scored.sort(key=lambda item: item[0])
    return [own, *[bounds for _, bounds in scored]][:max(1, limit)]


def all_cuts(num_blocks: int, num_stages: int) -> Iterable[list[int]]:
    """Every contiguous cut into non-empty stages, as boundary lists."""
    for inner in itertools.combinations(range(1, num_blocks), num_stages - 1):
        yield [0, *inner, num_blocks]


def exhaustive_plan(blocks: Sequence[BlockCost], devices: Sequence[DeviceSpec],
                    link: Link = Link(), microbatches: int = 8,
                    schedule: Schedule = "1f1b") -> Plan | None:
    """Best plan by trying every cut (slowest stage, then summed time); None if none fits."""
    best: tuple[float, float, Plan] | None = None
    for bounds in all_cuts(len(blocks), len(devices)):
        plan = plan_from_boundaries(blocks, devices, bounds, link, microbatches, schedule)
        if any(s.mem_cap_bytes is not None and s.mem_bytes > s.mem_cap_bytes
               for s in plan.stages):
            continue
        key = (plan.bottleneck_s, sum(s.time_s for s in plan.stages))
        if best is None or key < best[:2]:
            best = (*key, plan)
    return None if best is None else best[2]
