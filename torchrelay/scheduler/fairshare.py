"""Per-user accounting: dominant resource share, quotas, and the order jobs are considered in.

Contract:
- ``Accounts`` holds what each user uses now (cpus, gpus, memory, jobs), charged for running
  jobs and for every job placed or granted in this cycle. A preempted job is not refunded in
  the cycle that preempts it: it runs until it has stopped.
- ``share(user)``: the user's dominant share, the largest of used/total over cpus, gpus and
  memory of the ready nodes (Ghodsi et al., "Dominant Resource Fairness", NSDI 2011).
- ``quota_problem(user, demand)``: None when the user may take ``demand`` more (cpus, gpus,
  memory) and one more job without exceeding any of their quota limits; otherwise the reason.
- ``fair_order(queue, accounts)``: yields every queued job exactly once: higher priority first;
  within a priority, the job of the user with the smallest dominant share *at that moment*
  (shares change as the caller charges placements between steps), that user's jobs in submit
  order; ties by the earliest submit_seq, then job id. Deterministic for a given input.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterator

import numpy as np

from torchrelay.scheduler.types import QueuedJob, Quota

_DIM_NAMES = ("cpus", "gpus", "memory")


class Accounts:
    def __init__(self, totals: np.ndarray, quotas: dict[str, Quota]) -> None:
        # plain floats: this is called once per queued job, where numpy's per-call cost shows
        self._inv = [1.0 / float(t) if t > 0 else 0.0 for t in totals]
        self._quotas = quotas
        self._used: dict[str, list[float]] = {}
        self._jobs: dict[str, int] = {}
        self._share: dict[str, float] = {}

    def charge(self, user: str, amount: tuple[float, float, float]) -> None:
        """Add one job using ``amount`` (cpus, gpus, memory) to ``user``."""
        used = self._used.setdefault(user, [0.0, 0.0, 0.0])
        used[0] += amount[0]
        used[1] += amount[1]
        used[2] += amount[2]
        self._jobs[user] = self._jobs.get(user, 0) + 1
        inv = self._inv
        self._share[user] = max(used[0] * inv[0], used[1] * inv[1], used[2] * inv[2])

    def charge_many(self, charges) -> None:
        """``charge(user, amount)`` for each (user, amount) of ``charges``, in order (the same sums
        to the last bit), computing each user's share once."""
        used_of, jobs_of = self._used, self._jobs
        for user, amount in charges:
            used = used_of.get(user)
            if used is None:
                used = used_of[user] = [0.0, 0.0, 0.0]
            used[0] += amount[0]
            used[1] += amount[1]
            used[2] += amount[2]
            jobs_of[user] = jobs_of.get(user, 0) + 1
        inv = self._inv
        for user, used in used_of.items():
            self._share[user] = max(used[0] * inv[0], used[1] * inv[1], used[2] * inv[2])

    def used(self, user: str) -> tuple[float, float, float, int]:
        cpus, gpus, memory = self._used.get(user, (0.0, 0.0, 0.0))
        return cpus, gpus, memory, self._jobs.get(user, 0)

    def share(self, user: str) -> float:
        return self._share.get(user, 0.0)

    def quota_problem(self, user: str, demand: np.ndarray) -> str | None:
        quota = self._quotas.get(user)
        if quota is None:
            return None
        cpus, gpus, _, jobs = self.used(user)
        if quota.jobs is not None and jobs + 1 > quota.jobs:
            return f"user {user!r} runs {jobs} jobs, quota {quota.jobs} jobs"
        if quota.cpus is not None and cpus + demand[0] > quota.cpus + 1e-9:
            return f"user {user!r} would use {cpus + demand[0]:g} cpus, quota {quota.cpus:g}"
        if quota.gpus is not None and gpus + demand[1] > quota.gpus:
            return f"user {user!r} would use {gpus + demand[1]:g} gpus, quota {quota.gpus}"
        return None


def fair_order(queue: tuple[QueuedJob, ...], accounts: Accounts) -> Iterator[QueuedJob]:
    """Every job of ``queue`` once, in fair-share order (see module contract)."""
    by_priority: dict[int, dict[str, list[QueuedJob]]] = defaultdict(lambda: defaultdict(list))
    for job in queue:
        by_priority[job.priority][job.user].append(job)
    for priority in sorted(by_priority, reverse=True):
        per_user = by_priority[priority]
        for jobs in per_user.values():
            jobs.sort(key=lambda j: (j.submit_seq, j.job_id), reverse=True)  # pop() takes the next
        heap = [(accounts.share(user), jobs[-1].submit_seq, jobs[-1].job_id, user)
                for user, jobs in per_user.items()]
        heapq.heapify(heap)
        while heap:
            share, seq, job_id, user = heapq.heappop(heap)
            now_share = accounts.share(user)
            if now_share != share:  # charged since it was pushed: re-rank lazily (shares only grow)
                heapq.heappush(heap, (now_share, seq, job_id, user))
                continue
            jobs = per_user[user]
            while jobs:
                yield jobs.pop()
                if not jobs:
                    break
                head = (accounts.share(user), jobs[-1].submit_seq, jobs[-1].job_id, user)
                if heap and heap[0] < head:  # another user is next: back into the heap
                    heapq.heappush(heap, head)
                    break
