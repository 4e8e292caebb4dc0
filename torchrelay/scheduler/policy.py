"""One scheduling cycle: ``schedule(SchedulerInput) -> Decisions``. Pure: no I/O, no clock reads.

Contract (what the server and ``docs/scheduling.md`` rely on):
- Jobs are considered in ``fairshare.fair_order``: priority, then dominant-share fair share
  between users, then submit order. ``Decisions.order`` lists them in that order.
- Each job either gets a ``Placement`` for all its workers (gang: all or nothing), or waits
  with a reason in ``Decisions.waiting``. Placements never over-commit a node (cpus, gpus,
  memory) counting running allocations; nodes that are not ready get nothing.
- A job over its user's quota waits with ``quota``; one that no node set could ever hold (or
  that is malformed) waits with ``unschedulable``. Neither blocks anyone else.
- The first job that cannot start gets the EASY reservation (``backfill``); later jobs start
  only if they do not delay it. Before that, a blocked job may preempt lower-priority
  preemptible jobs (``preemption``): the victims are listed in ``Decisions.preemptions``, the
  job waits (reason ``resources``, naming them) until they have stopped, and their resources
  are kept for it in this cycle.
- Waiting reasons, each optionally followed by ": detail":
  ``resources``   no node set has room for any of its workers now;
  ``gang``        some of its workers would fit now, but not all of them together;
  ``quota``       starting it would exceed its user's quota;
  ``priority``    it fitted the free resources, but jobs ahead of it in the order took them;
  ``reservation`` it fits now but would delay the reserved start of the job at the head;
  ``unschedulable`` the cluster can never hold it (or the job is malformed).
- ``Decisions.estimated_start``: for the first ``estimate_limit`` waiting jobs (in order) whose
  start can be known from declared max runtimes.
- Same input (in any order of its tuples) gives the same decisions.
"""
from __future__ import annotations

import math

import numpy as np

from torchrelay.spec import format_memory
from torchrelay.scheduler.backfill import Holding, Reservation, Tiers, estimate_starts, reserve
from torchrelay.scheduler.cluster import Cluster, alternatives, check_input, job_problem, usage
from torchrelay.scheduler.fairshare import Accounts, fair_order
from torchrelay.scheduler.placement import Choice, place_best, use_of
from torchrelay.scheduler.preemption import choose_victims
from torchrelay.scheduler.types import Decisions, Placement, QueuedJob, SchedulerInput


class _FitMemo:
    """Remembers, per job kind and view, the smallest gang size that did not fit.

    Within a cycle the free resources only shrink (until a preemption frees some, which calls
    ``clear``), so a gang at least that large cannot fit either: this is what keeps a cycle
    over 10,000 queued jobs cheap once the cluster is full.
    """

    def __init__(self) -> None:
        self._fails: dict[tuple, int] = {}

    @staticmethod
    def key(job: QueuedJob, tiers: Tiers, view: str) -> tuple[tuple, int]:
        size = job.nodes if job.workers_per_node else job.workers
        return (tiers, job.labels, job.workers_per_node, view), size

    def known_fail(self, job: QueuedJob, tiers: Tiers, view: str) -> bool:
        key, size = self.key(job, tiers, view)
        smallest = self._fails.get(key)
        return smallest is not None and size >= smallest

    def record_fail(self, job: QueuedJob, tiers: Tiers, view: str) -> None:
        key, size = self.key(job, tiers, view)
        self._fails[key] = min(size, self._fails.get(key, size))

    def clear(self) -> None:
        self._fails.clear()


class _Cycle:
    def __init__(self, inp: SchedulerInput) -> None:
        check_input(inp)
        self.inp = inp
        self.now = inp.now
        self.cluster = cluster = Cluster(inp.nodes)
        self.ready = cluster.ready
        self.accounts = Accounts(cluster.total[cluster.ready].sum(axis=0), dict(inp.quotas))
        self.holdings: list[Holding] = []
        self.free = cluster.total.copy()
        for alloc in sorted(inp.running, key=lambda a: a.job_id):
            on_cluster = [(cluster.index[n], w) for n, w in alloc.placement if n in cluster.index]
            nodes = np.array([i for i, _ in on_cluster], dtype=np.int64)
            use = np.array([usage(alloc.shape, w) for _, w in on_cluster]).reshape(-1, 3)
            total = usage(alloc.shape, sum(w for _, w in alloc.placement))
            end = alloc.started_at + alloc.max_runtime_s if alloc.max_runtime_s is not None else math.inf
            self.holdings.append(Holding(alloc.job_id, alloc.user, alloc.priority, alloc.preemptible,
                                         alloc.preempting, alloc.started_at, end, nodes, use, total))
            np.subtract.at(self.free, nodes, use)
            self.accounts.charge(alloc.user, total)
        self.initial_free = self.free.copy()
        self.lowest_victim_priority = min(
            (h.priority for h in self.holdings if h.preemptible), default=math.inf)
        self.memo = _FitMemo()
        self.initial_memo: dict[tuple, bool] = {}
        self.ever_memo: dict[tuple, bool] = {}
        self.tiers_memo: dict[object, Tiers] = {}
        self.reservation: Reservation | None = None
        self.placements: list[Placement] = []
        self.preemptions: list[str] = []
        self.waiting: dict[str, str] = {}
        self.order: list[str] = []
        self.tiers_of: dict[str, Tiers] = {}

    # ------------------------------------------------------------------ helpers

    def tiers(self, job: QueuedJob) -> Tiers:
        key = job.shape
        found = self.tiers_memo.get(key)
        if found is None:
            found = self.tiers_memo[key] = alternatives(job, self.cluster)
        return found

    def fits_ever(self, job: QueuedJob, tiers: Tiers) -> bool:
        key = (tiers, job.labels, job.workers, job.workers_per_node)
        if key not in self.ever_memo:
            everywhere = np.ones(len(self.cluster), dtype=bool)
            self.ever_memo[key] = place_best(self.cluster, tiers, job, self.cluster.total, everywhere) is not None
        return self.ever_memo[key]

    def try_place(self, job: QueuedJob, tiers: Tiers, avail: np.ndarray, view: str) -> Choice | None:
        if self.memo.known_fail(job, tiers, view):
            return None
        choice = place_best(self.cluster, tiers, job, avail, self.ready)
        if choice is None:
            self.memo.record_fail(job, tiers, view)
        return choice

    def fitted_initially(self, job: QueuedJob, tiers: Tiers) -> bool:
        key = (tiers, job.labels, job.workers, job.workers_per_node)
        if key not in self.initial_memo:
            self.initial_memo[key] = place_best(self.cluster, tiers, job, self.initial_free, self.ready) is not None
        return self.initial_memo[key]

    def some_workers_fit(self, job: QueuedJob, tiers: Tiers) -> bool:
        one = QueuedJob(job.job_id, job.user, job.priority, job.submit_seq,
                        job.workers_per_node or 1, job.shape,
                        workers_per_node=job.workers_per_node, nodes=1 if job.workers_per_node else None,
                        labels=job.labels)
        return self.try_place(one, tiers, self.free, "free") is not None

    def within_quota(self, job: QueuedJob, tiers: Tiers) -> tuple[Tiers, str | None]:
        """The alternatives the user's quota allows, and the first quota problem met."""
        kept, first_problem = [], None
        for tier in tiers:
            fine = []
            for alt in tier:
                problem = self.accounts.quota_problem(job.user, usage(alt.shape, job.workers))
                if problem is None:
                    fine.append(alt)
                elif first_problem is None:
                    first_problem = problem
            if fine:
                kept.append(tuple(fine))
        return tuple(kept), first_problem

    def commit(self, job: QueuedJob, choice: Choice, *, limits_extra: bool) -> Holding:
        nodes, use = use_of(choice)
        np.subtract.at(self.free, nodes, use)
        if limits_extra and self.reservation is not None:
            np.subtract.at(self.reservation.extra, nodes, use)
        total = usage(choice.alt.shape, job.workers)
        end = self.now + job.max_runtime_s if job.max_runtime_s is not None else math.inf
        holding = Holding(job.job_id, job.user, job.priority, job.preemptible, False, self.now, end,
                          nodes, use, total, new=True)
        self.holdings.append(holding)
        self.accounts.charge(job.user, total)
        return holding

    # ------------------------------------------------------------------ the cycle

    def run(self) -> Decisions:
        for job in fair_order(tuple(self.inp.queue), self.accounts):
            self.order.append(job.job_id)
            reason = self.consider(job)
            if reason is not None:
                self.waiting[job.job_id] = reason
        estimates = self.estimates()
        return Decisions(placements=tuple(self.placements), preemptions=tuple(self.preemptions),
                         waiting=self.waiting, estimated_start=estimates, order=tuple(self.order))

    def consider(self, job: QueuedJob) -> str | None:
        """Place, grant (by preemption), reserve or explain ``job``; returns its waiting reason."""
        problem = job_problem(job)
        if problem is not None:
            return f"unschedulable: {problem}"
        tiers = self.tiers(job)
        if not self.fits_ever(job, tiers):
            return (f"unschedulable: {job.workers} workers of {_describe(job)} do not fit this cluster "
                    f"even when it is empty")
        tiers, over = self.within_quota(job, tiers)
        if not tiers:
            return f"quota: {over}"
        self.tiers_of[job.job_id] = tiers
        reservation = self.reservation
        short = reservation is not None and reservation.allows_short(self.now, job.max_runtime_s)
        if reservation is None or short:
            choice = self.try_place(job, tiers, self.free, "free")
        else:
            choice = self.try_place(job, tiers, np.minimum(self.free, reservation.extra), "long")
        if choice is not None:
            self.commit(job, choice, limits_extra=not short)
            self.placements.append(self.to_placement(job, choice))
            return None
        if job.priority > self.lowest_victim_priority:
            granted = self.preempt_for(job, tiers)
            if granted is not None:
                return granted
        if reservation is None:
            self.reservation = reserve(self.cluster, tiers, job, self.free, self.holdings, self.now, self.ready)
            base = self.shortage(job, tiers)
            if self.reservation is None:
                return f"{base}, and the nodes it needs are not ready"
            if self.reservation.start is None:
                return f"{base}; first in line: its nodes are kept for it as running jobs end"
            return f"{base}; first in line, reserved to start at {self.reservation.start:g}"
        if self.try_place(job, tiers, self.free, "free") is not None:
            when = "" if reservation.start is None else f" reserved to start at {reservation.start:g}"
            return f"reservation: starting now would delay job {reservation.job_id}{when}"
        if self.fitted_initially(job, tiers):
            return "priority: jobs ahead of it in the queue took the free resources"
        return self.shortage(job, tiers)

    def shortage(self, job: QueuedJob, tiers: Tiers) -> str:
        if self.some_workers_fit(job, tiers):
            return f"gang: some of its {job.workers} workers would fit now, but not all together"
        return f"resources: no room now for a worker of {_describe(job)}"

    def preempt_for(self, job: QueuedJob, tiers: Tiers) -> str | None:
        allowed = self.ready.copy()
        if self.reservation is not None:
            allowed[[i for i, _ in self.reservation.choice.placement]] = False
        found = choose_victims(self.cluster, tiers, job, self.free, self.holdings, allowed)
        if found is None:
            return None
        victims, choice = found
        for victim in victims:
            np.add.at(self.free, victim.nodes, victim.use)
            self.holdings.remove(victim)
            self.accounts.refund(victim.user, victim.total)
            if not victim.preempting:
                self.preemptions.append(victim.job_id)
        # Kept for this job: it starts in a later cycle, once the victims have stopped.
        self.commit(job, choice, limits_extra=False)
        self.memo.clear()
        names = ", ".join(v.job_id for v in victims)
        return f"resources: preempting lower-priority job(s) {names}; starts once they have stopped"

    def to_placement(self, job: QueuedJob, choice: Choice) -> Placement:
        ids = self.cluster.ids
        ordered = sorted(choice.placement, key=lambda p: (-p[1], ids[p[0]]))
        return Placement(job.job_id, tuple((ids[i], w) for i, w in ordered), choice.alt.shape)

    def estimates(self) -> dict[str, float]:
        limit = self.inp.estimate_limit
        if limit == 0:
            return {}
        queued = {j.job_id: j for j in self.inp.queue}
        waiting = []
        for job_id in self.order:
            reason = self.waiting.get(job_id, "")
            if reason.split(":", 1)[0] in ("resources", "gang", "priority", "reservation") \
                    and "preempting" not in reason and job_id in self.tiers_of:
                waiting.append((queued[job_id], self.tiers_of[job_id]))
                if len(waiting) >= limit:
                    break
        return estimate_starts(self.cluster, waiting, self.free, self.holdings, self.now, self.ready)


def _describe(job: QueuedJob) -> str:
    shape = job.shape
    parts = [f"{shape.cpu:g} cpu"]
    if shape.gpu or shape.accelerator != "none":
        parts.append(f"{max(shape.gpu, 1)} gpu" + (f" ({shape.gpu_type})" if shape.gpu_type else ""))
    if shape.memory:
        parts.append(f"{format_memory(shape.memory)} memory")
    where = f" on {job.nodes} nodes × {job.workers_per_node}" if job.workers_per_node else ""
    labels = f" with labels {dict(job.labels)}" if job.labels else ""
    return ", ".join(parts) + where + labels


def schedule(inp: SchedulerInput) -> Decisions:
    """Decide one cycle (see module contract). Raises ``InvalidSpec`` on duplicate ids or
    negative node resources; a malformed job only waits as ``unschedulable``."""
    return _Cycle(inp).run()


def fits_ever(job: QueuedJob, nodes: tuple) -> bool:
    """Whether ``job`` could be placed on ``nodes`` were they all empty and ready."""
    if job_problem(job) is not None:
        return False
    cycle_cluster = Cluster(tuple(nodes))
    everywhere = np.ones(len(cycle_cluster), dtype=bool)
    return place_best(cycle_cluster, alternatives(job, cycle_cluster), job, cycle_cluster.total,
                      everywhere) is not None
