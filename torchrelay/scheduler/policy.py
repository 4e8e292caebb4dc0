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
- Jobs with roles (``QueuedJob.roles``, e.g. a parameter-server job's servers): every role is
  placed with the workers, all or nothing (``placement``'s routine); quotas, fair share,
  reservations, estimates and preemption count the sum of all roles, and a running
  ``Allocation``'s roles hold resources like its workers. A job whose workers fit now but not
  its roles next to them waits with ``gang``, naming the role.
- Elastic jobs (``min_workers``; ``shrink``): a queued one that does not fit whole starts now
  with as many workers as fit, down to ``min_workers`` (in the free resources, or what the
  reservation leaves, as any job); a blocked job first tries to make room by shrinking running
  lower-priority elastic jobs (``Decisions.shrinks``; it waits, reason ``resources`` naming
  them, until their workers have left) and preempts whole only when that is not enough. An
  elastic job that must wait, preempt or be reserved for asks for its ``min_workers``. A job
  shrunk in a cycle is not also preempted in it. Elastic jobs take none of the shortcuts below.
  After the queue, running elastic jobs below their ``max_workers`` are grown into what is left
  free (``grow``; ``Decisions.grows``), the highest priority first, never delaying the
  reservation (as a backfilled job without a runtime limit) nor while a queued job of their
  priority or higher waits for resources.

Cost (a cycle over 10,000 queued jobs must stay well under 100 ms): jobs of one kind (shape,
gang form, labels) share what can be computed once; a gang size that did not fit is not tried
again for larger gangs of the same family; "does it fit?" is answered by ``fitindex`` without
a scan of the nodes; and once a job meets a reason that holds for the rest of the cycle
("priority", "resources"), later jobs alike in all it depends on (kind, whether it ends before
the reservation, priority where it may preempt; users without a quota) get it by one lookup.
None of these changes a decision: they skip work whose answer is already known. Jobs with
roles take none of the shortcuts that assume a gang's fit only shrinks with the resources
(their placement is step by step): they are few, and each is checked on its own.
"""
from __future__ import annotations

import dataclasses
import gc
import math

import numpy as np

from torchrelay.scheduler.backfill import Holding, Reservation, Tiers, estimate_starts, reserve
from torchrelay.scheduler.cluster import (Cluster, alternatives, check_input, gang_problem, job_problem,
                                          runtime_problem, usage, without_roles)
from torchrelay.scheduler.fairshare import Accounts, fair_order
from torchrelay.scheduler.fitindex import FitIndex
from torchrelay.scheduler.grow import candidates, grow_one
from torchrelay.scheduler.placement import (Choice, feasible, largest_fitting, nodes_of, on_cpu, place_best,
                                            use_of)
from torchrelay.scheduler.preemption import VictimPool
from torchrelay.scheduler.shrink import ShrinkPool
from torchrelay.scheduler.types import Allocation, Decisions, Grow, Placement, QueuedJob, SchedulerInput, Shrink
from torchrelay.spec import format_memory


_FOR_GOOD = -1  # an outcome version that never expires


class _FitMemo:
    """Remembers, per job kind and view, the smallest gang that did not fit.

    Within a cycle the resources of each view only shrink (``free`` as jobs are placed or
    granted, ``long`` as the reservation's spare room is used, ``preempt@p`` as victims are
    taken), so a gang at least that large cannot fit either: this is what keeps a cycle over
    10,000 queued jobs cheap once the cluster is full.
    """

    def __init__(self) -> None:
        self._fails: dict[tuple, int] = {}

    def known_fail(self, key: tuple, size: int) -> bool:
        smallest = self._fails.get(key)
        return smallest is not None and size >= smallest

    def record_fail(self, key: tuple, size: int) -> None:
        self._fails[key] = min(size, self._fails.get(key, size))


class _Kind:
    """What every job of one kind (shape, gang form, labels) shares in a cycle, computed once;
    the parts only some jobs need are computed on first use."""

    __slots__ = ("family", "job", "problem", "tiers", "ever", "initially", "size", "_description",
                 "_one_worker", "_demands", "cluster")

    def __init__(self, family: int, job: QueuedJob, cycle: "_Cycle") -> None:
        self.family = family
        self.job = job
        self.cluster = cycle.cluster
        self.problem = gang_problem(job)  # the runtime is checked per job
        self.size = job.nodes if job.workers_per_node else job.workers
        self._description = self._one_worker = self._demands = None
        self.initially: bool | None = None
        if self.problem is None:
            self.tiers = cycle.tiers_for(job.shape)
            self.ever = cycle.fits_ever(job, self.tiers, self.size)

    @property
    def description(self) -> str:
        if self._description is None:
            self._description = _describe(self.job)
        return self._description

    @property
    def roles_description(self) -> str:
        return ", ".join(f"{name} ×{count} ({_describe_shape(shape)} each)" for name, count, shape in self.job.roles)

    @property
    def one_worker(self) -> QueuedJob:
        """The same kind with one worker (one node of ``workers_per_node``): "would any fit?"."""
        if self._one_worker is None:
            job = self.job
            self._one_worker = QueuedJob(job.job_id, job.user, job.priority, job.submit_seq,
                                         job.workers_per_node or 1, job.shape,
                                         workers_per_node=job.workers_per_node,
                                         nodes=1 if job.workers_per_node else None, labels=job.labels)
        return self._one_worker

    @property
    def demands(self) -> list[list[np.ndarray]]:
        """Per alternative, what the whole job takes, its roles included (for quotas); a
        mixed-device job at most (as if every worker were a GPU rank), as where it runs is
        decided after the quota check."""
        if self._demands is None:
            roles = np.zeros(3)
            for role in self.cluster.roles_of(self.job):
                roles += role.demand
            self._demands = [[usage(alt.shape, self.job.workers) + roles for alt in tier] for tier in self.tiers]
        return self._demands


class _Cycle:
    def __init__(self, inp: SchedulerInput) -> None:
        check_input(inp)
        self.inp = inp
        self.now = inp.now
        self.cluster = cluster = Cluster(inp.nodes)
        self.ready = cluster.ready
        self.quotas = dict(inp.quotas)
        self.accounts = Accounts(cluster.total[cluster.ready].sum(axis=0), self.quotas)
        self.holdings: dict[str, Holding] = {}
        self.free = cluster.total.copy()
        index = cluster.index
        allocs = sorted(inp.running, key=lambda a: a.job_id)
        # one pass over thousands of running jobs: plain lists first, numpy arrays once
        rows_nodes, rows_use, spans = [], [], []
        add_node, add_use, node_of = rows_nodes.append, rows_use.append, index.get
        for alloc in allocs:
            if alloc.roles or alloc.on_cpu:
                low = len(rows_nodes)
                spans.append((low, low + _add_roles(alloc, node_of, add_node, add_use), _total(alloc)))
                continue
            shape = alloc.shape
            cpu, gpu, memory = shape.cpu, shape.gpu, shape.memory
            low, workers = len(rows_nodes), 0
            for node_id, count in alloc.placement:
                workers += count
                node = node_of(node_id)
                if node is not None:
                    add_node(node)
                    add_use((cpu * count, gpu * count, memory * count))
            spans.append((low, len(rows_nodes), (float(cpu * workers), float(gpu * workers), float(memory * workers))))
        all_nodes = np.array(rows_nodes, dtype=np.int64)
        all_use = np.array(rows_use, dtype=np.float64).reshape(-1, 3)
        holdings, inf = self.holdings, math.inf
        for alloc, (low, high, total) in zip(allocs, spans):
            runtime = alloc.max_runtime_s
            holdings[alloc.job_id] = Holding(alloc.job_id, alloc.user, alloc.priority, alloc.preemptible,
                                             alloc.preempting, alloc.started_at,
                                             alloc.started_at + runtime if runtime is not None else inf,
                                             all_nodes[low:high], all_use[low:high], total)
        self.accounts.charge_many((alloc.user, span[2]) for alloc, span in zip(allocs, spans))
        self.free -= _per_node(all_nodes, all_use, len(cluster))
        self.initial_free = self.free.copy()
        # fit checks against the free resources (changing), those at the start of the cycle and
        # the empty cluster (both fixed): see ``fitindex``
        self.free_index = FitIndex(cluster, self.free, self.ready)
        self.initial_index = FitIndex(cluster, self.initial_free, self.ready)
        self.empty_index = FitIndex(cluster, cluster.total, np.ones(len(cluster), dtype=bool))
        self._long_rows: tuple[int, Reservation, dict[int, list[float]]] | None = None
        self.victims = VictimPool(list(self.holdings.values()), len(cluster))
        self.lowest_victim_priority = self.victims.lowest_priority  # fixed for the cycle
        self.shrinkable = ShrinkPool(cluster, allocs)
        self.shrunk: set[str] = set()  # jobs shrunk in this cycle (out of the victim pool)
        self.shrinks: list[Shrink] = []
        self.memo = _FitMemo()
        self.kinds: dict[tuple, _Kind] = {}
        self.families: dict[tuple, int] = {}
        self.tiers_by_shape: dict[object, Tiers] = {}
        self.ever_bounds: dict[tuple, tuple[float, float]] = {}
        # waiting reasons by job kind, valid while ``version`` (bumped by every commit) is unchanged
        self.outcomes: dict[tuple, tuple[int, str]] = {}
        # (kind key, short, priority when it may preempt) -> (reason, tiers) for jobs of users
        # without a quota whose outcome holds for the rest of the cycle
        self.settled: dict[tuple, tuple[str, Tiers]] = {}
        self.version = 0
        self.reservation: Reservation | None = None
        self.placements: list[Placement] = []
        self.preemptions: list[str] = []
        self.waiting: dict[str, str] = {}
        self.order: list[str] = []
        self.considered: list[QueuedJob] = []  # the jobs of ``order``
        self.tiers_of: dict[str, Tiers] = {}

    # ------------------------------------------------------------------ helpers

    def tiers_for(self, shape) -> Tiers:
        found = self.tiers_by_shape.get(shape)
        if found is None:
            probe = QueuedJob("", "", 0, 0, 1, shape)
            found = self.tiers_by_shape[shape] = alternatives(probe, self.cluster)
        return found

    def fits_ever(self, job: QueuedJob, tiers: Tiers, size: int) -> bool:
        """Whether the kind fits the empty cluster; monotone in the gang size, so remembered as
        the largest size known to fit and the smallest known not to (not for jobs with roles)."""
        if job.roles:
            return self.empty_index.fits(tiers, job)
        key = (tiers, job.labels, job.workers_per_node)
        fits_up_to, fails_from = self.ever_bounds.get(key, (0, math.inf))
        if size <= fits_up_to:
            return True
        if size >= fails_from:
            return False
        ok = self.empty_index.fits(tiers, job)
        self.ever_bounds[key] = (max(fits_up_to, size), fails_from) if ok else (fits_up_to, min(fails_from, size))
        return ok

    def kind(self, job: QueuedJob, key: tuple | None = None) -> _Kind:
        """The job's kind; ``key`` is ``_kind_key(job)`` when the caller has it."""
        if key is None:
            key = _kind_key(job)
        found = self.kinds.get(key)
        if found is None:
            # kinds differing only in their gang size (workers, or nodes of workers_per_node) form
            # a family: the fit memo and the outcomes are kept per family and size
            family = self.families.setdefault(key[:5] + (job.workers_per_node, key[8], key[9]), len(self.families))
            found = self.kinds[key] = _Kind(family, job, self)
        return found

    def long_rows(self) -> dict[int, list[float]]:
        """The rows of the backfill view ``min(free, reservation.extra)`` where it departs from
        ``free``: only on the reserved job's nodes (``extra`` is inf elsewhere)."""
        reservation = self.reservation
        cached = self._long_rows
        if cached is None or cached[0] != self.version or cached[1] is not reservation:
            nodes = nodes_of(reservation.choice)
            rows = np.minimum(self.free[nodes], reservation.extra[nodes]).tolist()
            cached = self._long_rows = (self.version, reservation, dict(zip(nodes, rows)))
        return cached[2]

    def try_place(self, job: QueuedJob, tiers: Tiers, key: tuple, size: int, long: bool) -> Choice | None:
        """The placement of ``job`` in the free resources, or with ``long`` in what the
        reservation leaves (``min(free, extra)``); None (remembered in the memo) when none."""
        memo = not job.roles
        if memo and self.memo.known_fail(key, size):
            return None
        override = self.long_rows() if long else None
        if not self.free_index.fits(tiers, job, override):
            if memo:
                self.memo.record_fail(key, size)
            return None
        avail = np.minimum(self.free, self.reservation.extra) if long else self.free
        choice = place_best(self.cluster, tiers, job, avail, self.ready, self.free_index, override)
        if choice is None and memo:  # cannot happen: the index said it fits
            self.memo.record_fail(key, size)
        return choice

    def fits(self, job: QueuedJob, tiers: Tiers, key: tuple, size: int) -> bool:
        """Like ``try_place`` in the free resources, for a yes/no answer only."""
        if job.roles:
            return self.free_index.fits(tiers, job)
        if self.memo.known_fail(key, size):
            return False
        if self.free_index.fits(tiers, job):
            return True
        self.memo.record_fail(key, size)
        return False

    def within_quota(self, job: QueuedJob, kind: _Kind) -> tuple[Tiers, str | None]:
        """The alternatives the user's quota allows, and the first quota problem met."""
        kept, first_problem = [], None
        for tier, demands in zip(kind.tiers, kind.demands):
            fine = []
            for alt, demand in zip(tier, demands):
                problem = self.accounts.quota_problem(job.user, demand)
                if problem is None:
                    fine.append(alt)
                elif first_problem is None:
                    first_problem = problem
            if fine:
                kept.append(tuple(fine))
        return tuple(kept), first_problem

    def commit(self, job: QueuedJob, choice: Choice, *, limits_extra: bool, consume: bool = True) -> Holding:
        nodes, use = use_of(choice, self.cluster)
        if consume:
            np.subtract.at(self.free, nodes, use)
            self.free_index.touch(nodes)
        if limits_extra and self.reservation is not None:
            np.subtract.at(self.reservation.extra, nodes, use)
        if choice.alt.mixed:  # what it takes depends on the nodes: exactly what was taken, roles too
            used = use.sum(axis=0)
        else:
            used = usage(choice.alt.shape, job.workers)
            for _, alt, placement in choice.roles:
                used += usage(alt.shape, sum(count for _, count in placement))
        total = tuple(used.tolist())
        end = self.now + job.max_runtime_s if job.max_runtime_s is not None else math.inf
        holding = Holding(job.job_id, job.user, job.priority, job.preemptible, False, self.now, end,
                          nodes, use, total, new=True)
        self.holdings[job.job_id] = holding
        self.version += 1  # resources changed: outcomes remembered so far no longer hold
        self.accounts.charge(job.user, total)
        return holding

    # ------------------------------------------------------------------ the cycle

    def run(self) -> Decisions:
        for job in fair_order(tuple(self.inp.queue), self.accounts):
            self.order.append(job.job_id)
            self.considered.append(job)
            reason = self.consider(job)
            if reason is not None:
                self.waiting[job.job_id] = reason
        grows = self.grow()
        estimates = self.estimates()
        return Decisions(placements=tuple(self.placements), preemptions=tuple(self.preemptions),
                         shrinks=tuple(self.shrinks), grows=grows, waiting=self.waiting,
                         estimated_start=estimates, order=tuple(self.order))

    def grow(self) -> tuple[Grow, ...]:
        """After the queue: running elastic jobs below their workers take what is left free
        (``grow``), and only what does not delay the reservation (as a backfilled job without a
        runtime limit would), unless a queued job of their priority or higher waits for
        resources (one that can never run, or is over its quota, does not count)."""
        found = candidates(self.inp.running, self.shrunk)
        if not found:
            return ()
        priorities = {job.job_id: job.priority for job in self.considered}
        blocking = max((priorities[job_id] for job_id, reason in self.waiting.items()
                        if not reason.startswith(("unschedulable", "quota"))), default=None)
        ids, out = self.cluster.ids, []
        for alloc in found:
            if blocking is not None and blocking >= alloc.priority:
                continue
            # as a backfilled job without a runtime limit: within what the reservation leaves
            avail = self.free if self.reservation is None else np.minimum(self.free, self.reservation.extra)
            grown = grow_one(self.cluster, alloc, avail, self.ready)
            if grown is None:
                continue
            _, choice = grown
            nodes, use = use_of(choice, self.cluster)
            np.subtract.at(self.free, nodes, use)
            if self.reservation is not None:
                np.subtract.at(self.reservation.extra, nodes, use)
            self.free_index.touch(nodes)
            add = tuple((ids[n], k) for n, k in sorted(choice.placement, key=lambda p: ids[p[0]]))
            out.append(Grow(alloc.job_id, add, choice.alt.shape))
        return tuple(out)

    def consider(self, job: QueuedJob) -> str | None:
        """Place, grant (by shrinking or preemption), reserve or explain ``job``; returns its
        waiting reason."""
        runtime = job.max_runtime_s
        reservation = self.reservation
        # inline ``reservation.allows_short``: this runs for every queued job
        short = (reservation is not None and runtime is not None and reservation.start is not None
                 and self.now + runtime <= reservation.start)
        lowest = self.lowest_victim_priority
        may_preempt = lowest is not None and job.priority > lowest
        elastic = job.min_workers is not None and job.min_workers < job.workers
        # Most of a long queue meets a reason that holds for the rest of the cycle ("priority",
        # "resources"): jobs alike in all that reason depends on get it in one lookup.
        quota_free = job.user not in self.quotas
        shortcuts = quota_free and not elastic
        kind_key = _kind_key(job)
        alike = (kind_key, short, job.priority if may_preempt else None)
        if shortcuts and (runtime is None or runtime > 0):
            settled = self.settled.get(alike)
            if settled is not None:
                self.tiers_of[job.job_id] = settled[1]
                return settled[0]
        kind = self.kind(job, kind_key)
        problem = kind.problem or (runtime_problem(job) if runtime is not None and not runtime > 0 else None)
        if problem is not None:
            return f"unschedulable: {problem}"
        # what an elastic job waits, preempts and is reserved for: its smallest form
        target = dataclasses.replace(job, workers=job.min_workers) if elastic else job
        if not kind.ever and not (elastic and self.fits_ever(target, kind.tiers, target.workers)):
            return self.never_fits(job, kind)
        if not quota_free:
            tiers, over = self.within_quota(job, kind)
            if not tiers:
                return f"quota: {over}"
            signature = (kind.family, tuple(a.gpu_key for tier in tiers for a in tier))
        else:
            tiers, signature = kind.tiers, (kind.family,)
        self.tiers_of[job.job_id] = tiers
        size = kind.size
        outcome_key = (signature, size, short, job.priority if may_preempt else None)
        if reservation is not None and not elastic:
            # Once the cluster is full most jobs meet a state seen before: reuse that outcome.
            seen = self.outcomes.get(outcome_key)
            if seen is not None and (seen[0] == self.version or seen[0] == _FOR_GOOD):
                if seen[0] == _FOR_GOOD and quota_free:
                    self.settled[alike] = (seen[1], tiers)
                return seen[1]
        if self.place_now(job, tiers, signature, size, long=not (reservation is None or short), short=short):
            return None
        if may_preempt:
            granted = (self.shrink_for(target, tiers)
                       or self.preempt_for(target, tiers, (signature, "preempt", job.priority), target.workers))
            if granted is not None:
                return granted
        if reservation is None:
            self.reservation = reserve(self.cluster, tiers, target, self.free, list(self.holdings.values()),
                                       self.now, self.ready)
            base = self.explain(target, kind, tiers, signature)
            if self.reservation is None:
                return f"{base}; and the nodes it needs are not ready"
            if self.reservation.start is None:
                return f"{base}; first in line: its nodes are kept for it as running jobs end"
            return f"{base}; first in line, reserved to start at {self.reservation.start:g}"
        if self.fits(target, tiers, (signature, "free"), target.workers if elastic else size):
            when = "" if reservation.start is None else f", reserved to start at {reservation.start:g}"
            reason = f"reservation: starting now would delay job {reservation.job_id}{when}"
        else:
            reason = self.explain(target, kind, tiers, signature)
        # Resources only shrink within a cycle, so "priority" (it fitted at the start, not now)
        # and "resources" (not even one worker fits) stay true; the others may change.
        # (For a job with roles only "resources" does: it says not even one worker fits.)
        lasting = reason.startswith(("priority", "resources") if not job.roles else "resources")
        if not elastic:
            self.outcomes[outcome_key] = (_FOR_GOOD if lasting else self.version, reason)
        if lasting and shortcuts:
            self.settled[alike] = (reason, tiers)
        return reason

    def never_fits(self, job: QueuedJob, kind: _Kind) -> str:
        """The reason of a job that the empty cluster could not hold."""
        if job.roles and self.empty_index.fits(kind.tiers, without_roles(job)):
            return (f"unschedulable: {job.workers} workers of {kind.description} fit this cluster when it "
                    f"is empty, but not together with {kind.roles_description}")
        at_least = f" (elastic: at least {job.min_workers})" if job.min_workers is not None else ""
        return (f"unschedulable: {job.workers} workers{at_least} of {kind.description} do not fit this cluster "
                f"even when it is empty")

    def place_now(self, job: QueuedJob, tiers: Tiers, signature: tuple, size: int, *, long: bool,
                  short: bool) -> bool:
        """Place ``job`` in the free resources (``long``: in what the reservation leaves), an
        elastic one with as many workers as fit; whether it was placed."""
        key = (signature, "long" if long else "free")
        placed, choice = job, self.try_place(job, tiers, key, size, long)
        if choice is None and job.min_workers is not None and job.min_workers < job.workers:
            placed, choice = self.try_smaller(job, tiers, key, long)
        if choice is None:
            return False
        self.commit(placed, choice, limits_extra=not short)
        self.placements.append(self.to_placement(placed, choice))
        return True

    def try_smaller(self, job: QueuedJob, tiers: Tiers, key: tuple, long: bool) -> tuple[QueuedJob, Choice | None]:
        """The elastic ``job`` with the most workers (fewer than asked, at least ``min_workers``)
        that fit, and its placement; fit is monotone in the gang size, so found by bisection."""
        override = self.long_rows() if long else None

        def fits(workers: int) -> bool:
            return (not self.memo.known_fail(key, workers)
                    and self.free_index.fits(tiers, dataclasses.replace(job, workers=workers), override))

        low = job.min_workers
        if not fits(low):
            self.memo.record_fail(key, low)
            return job, None
        low = largest_fitting(low, job.workers - 1, fits)
        smaller = dataclasses.replace(job, workers=low)
        return smaller, self.try_place(smaller, tiers, key, low, long)

    def shrink_for(self, job: QueuedJob, tiers: Tiers) -> str | None:
        """Make room for ``job`` by taking workers back from lower-priority elastic jobs
        (``shrink``); its waiting reason, or None when that is not enough."""
        allowed = self.ready.copy()
        if self.reservation is not None:
            allowed[nodes_of(self.reservation.choice)] = False
        found = self.shrinkable.choose(self.cluster, tiers, job, self.free, allowed)
        if found is None:
            return None
        release, choice = found
        ids = self.cluster.ids
        released = np.zeros_like(self.free)
        for job_id, per_node in sorted(release.items()):
            for node, held in self.shrinkable.take(job_id, per_node).items():
                released[node] += held
            if job_id not in self.shrunk:  # it goes on smaller: not also preempted in this cycle
                self.shrunk.add(job_id)
                self.victims.remove(self.holdings[job_id])
            self.shrinks.append(Shrink(job_id, tuple((ids[n], k) for n, k in sorted(per_node.items(),
                                                                                    key=lambda p: ids[p[0]])),
                                       job.job_id))
        self.grant(job, choice, released)
        names = ", ".join(f"{s.job_id} ({s.workers} worker{'s' if s.workers > 1 else ''})"
                          for s in self.shrinks if s.for_job == job.job_id)
        return f"resources: shrinking lower-priority elastic job(s) {names}; starts once their workers have left"

    def grant(self, job: QueuedJob, choice: Choice, released: np.ndarray) -> None:
        """Keep ``choice`` for ``job``, which starts in a later cycle once what others give back
        (``released``, still in use meanwhile) is free: what they free beyond the job's share is
        not handed out in this cycle either (which also keeps ``free`` shrinking, as the memo
        assumes)."""
        nodes, use = use_of(choice, self.cluster)
        after = self.free + released
        np.subtract.at(after, nodes, use)
        np.minimum(self.free, after, out=self.free)
        self.free_index.touch(nodes)
        self.commit(job, choice, limits_extra=False, consume=False)
    def explain(self, job: QueuedJob, kind: _Kind, tiers: Tiers, signature: tuple) -> str:
        """Why a job that does not fit the free resources waits: priority, gang or resources."""
        if kind.initially is None:
            kind.initially = self.initial_index.fits(kind.tiers, job)
        if kind.initially:
            return "priority: jobs ahead of it in the queue took the free resources"
        return self.shortage(job, kind, tiers, signature)

    def shortage(self, job: QueuedJob, kind: _Kind, tiers: Tiers, signature: tuple) -> str:
        if job.roles and self.free_index.fits(tiers, without_roles(job)):
            return (f"gang: its {job.workers} workers would fit now, but not together with "
                    f"{kind.roles_description}")
        if self.fits(kind.one_worker, tiers, (signature, "free"), 1):
            return f"gang: some of its {job.workers} workers would fit now, but not all together"
        return f"resources: no room now for a worker of {kind.description}"

    def preempt_for(self, job: QueuedJob, tiers: Tiers, key: tuple, size: int) -> str | None:
        memo = not job.roles
        if memo and self.memo.known_fail(key, size):
            return None
        allowed = self.ready.copy()
        if self.reservation is not None:
            allowed[nodes_of(self.reservation.choice)] = False
        found = self.victims.choose(self.cluster, tiers, job, self.free, allowed)
        if found is None:
            # free + preemptible resources only shrink in a cycle: a larger gang fails too
            if memo:
                self.memo.record_fail(key, size)
            return None
        victims, choice = found
        released = np.zeros_like(self.free)
        for victim in victims:
            np.add.at(released, victim.nodes, victim.use)
            self.victims.remove(victim)
            del self.holdings[victim.job_id]
            self.shrinkable.drop(victim.job_id)
            # no refund: the victim runs (and counts against its user's quota) until it stops
            if not victim.preempting:
                self.preemptions.append(victim.job_id)
        # The job starts in a later cycle, once the victims have stopped.
        self.grant(job, choice, released)
        names = ", ".join(v.job_id for v in victims)
        return f"resources: preempting lower-priority job(s) {names}; starts once they have stopped"

    def to_placement(self, job: QueuedJob, choice: Choice) -> Placement:
        ids = self.cluster.ids

        def named(placement):
            return tuple((ids[i], w) for i, w in sorted(placement, key=lambda p: (-p[1], ids[p[0]])))

        roles = tuple((name, alt.shape, named(placement)) for name, alt, placement in choice.roles)
        cpu_nodes = tuple(ids[i] for i in sorted(on_cpu(self.cluster, choice), key=lambda i: ids[i]))
        return Placement(job.job_id, named(choice.placement), choice.alt.shape, roles, cpu_nodes)

    def estimates(self) -> dict[str, float]:
        limit = self.inp.estimate_limit
        if limit == 0:
            return {}
        waiting = []
        for job in self.considered:
            job_id = job.job_id
            reason = self.waiting.get(job_id, "")
            if reason.startswith(("resources", "gang", "priority", "reservation")) \
                    and "preempting" not in reason and "shrinking" not in reason and job_id in self.tiers_of:
                waiting.append((job, self.tiers_of[job_id]))
                if len(waiting) >= limit:
                    break
        return estimate_starts(self.cluster, waiting, self.free, list(self.holdings.values()), self.now,
                               self.ready)


def _kind_key(job: QueuedJob) -> tuple:
    """What makes a job's kind: its shape, gang form and labels. Plain values, not the shape
    dataclass, as hashing and comparing that is a large part of a queued job's cost."""
    shape = job.shape
    return (shape.cpu, shape.gpu, shape.memory, shape.gpu_type, shape.accelerator, job.workers,
            job.workers_per_node, job.nodes, job.labels, job.roles, job.min_workers)


def _per_node(nodes: np.ndarray, use: np.ndarray, count: int) -> np.ndarray:
    """Sum of ``use`` rows per node index (faster than ``np.add.at`` for many rows)."""
    return np.stack([np.bincount(nodes, weights=use[:, dim], minlength=count) for dim in range(3)], axis=1)


def _describe(job: QueuedJob) -> str:
    where = f" on {job.nodes} nodes × {job.workers_per_node}" if job.workers_per_node else ""
    labels = f" with labels {dict(job.labels)}" if job.labels else ""
    return _describe_shape(job.shape) + where + labels


def _describe_shape(shape) -> str:
    parts = [f"{shape.cpu:g} cpu"]
    if shape.gpu or shape.accelerator != "none":
        parts.append(f"{max(shape.gpu, 1)} gpu" + (f" ({shape.gpu_type})" if shape.gpu_type else "")
                     + (" on GPU nodes" if shape.accelerator == "any" else ""))
    if shape.memory:
        parts.append(f"{format_memory(shape.memory)} memory")
    return ", ".join(parts)


def _role_parts(alloc: Allocation):
    """(shape, placement) of the workers (GPU and CPU ones apart) and of each role of ``alloc``."""
    return alloc.parts()


def _add_roles(alloc: Allocation, node_of, add_node, add_use) -> int:
    """Rows of an allocation with roles: one per node of this cluster, all roles summed there
    (so a node's rows never repeat within a job). Returns how many rows were added."""
    rows: dict[int, list[float]] = {}
    for shape, placement in _role_parts(alloc):
        for node_id, count in placement:
            node = node_of(node_id)
            if node is not None:
                row = rows.setdefault(node, [0.0, 0.0, 0.0])
                row[0] += shape.cpu * count
                row[1] += shape.gpu * count
                row[2] += shape.memory * count
    for node in sorted(rows):
        add_node(node)
        add_use(tuple(rows[node]))
    return len(rows)


def _total(alloc: Allocation) -> tuple[float, float, float]:
    """What ``alloc`` holds over all its nodes (on this cluster or not), all roles."""
    cpu = gpu = memory = 0.0
    for shape, placement in _role_parts(alloc):
        count = sum(c for _, c in placement)
        cpu += shape.cpu * count
        gpu += shape.gpu * count
        memory += shape.memory * count
    return float(cpu), float(gpu), float(memory)


def schedule(inp: SchedulerInput) -> Decisions:
    """Decide one cycle (see module contract). Raises ``InvalidSpec`` on duplicate ids or
    negative node resources; a malformed job only waits as ``unschedulable``."""
    # A cycle over thousands of jobs allocates tens of thousands of small objects that all live
    # until it returns and form no reference cycles: Python's cyclic collector would run dozens of
    # times during it, now and then over the caller's whole heap (the server's, the benchmark's),
    # finding nothing. Paused for the cycle, restored as it was, whatever happens.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _Cycle(inp).run()
    finally:
        if was_enabled:
            gc.enable()


def fits_ever(job: QueuedJob, nodes: tuple) -> bool:
    """Whether ``job`` could be placed on ``nodes`` were they all empty and ready (an elastic
    job: with its ``min_workers``)."""
    if job_problem(job) is not None:
        return False
    if job.min_workers is not None:  # an elastic job runs with its min_workers at least
        job = dataclasses.replace(job, workers=job.min_workers)
    cycle_cluster = Cluster(tuple(nodes))
    everywhere = np.ones(len(cycle_cluster), dtype=bool)
    return feasible(cycle_cluster, alternatives(job, cycle_cluster), job, cycle_cluster.total, everywhere)
