"""What the server process remembers of its rows between transactions, and what it derives once.

- ``JobFacts``: what a job's spec implies (its policy view while it waits, its workers'
  environment, its argv), derived lazily once per process: specs never change after submit.
- ``NodeFacts``: every node as the policy sees it, with names and GPU types.
- ``Cache``: both, for one service. Job facts are dropped when a job ends; node facts whenever a
  node changes (and after a failed transaction); a load that raced with a change is not kept.

No queries here: ``rows.py`` loads what is missing. Guarded by the store's writer lock for
writes; reads without the lock only ever add what the rows already imply.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from torchrelay import scheduler as policy
from torchrelay.server.assignment import WorkerEnvironment
from torchrelay.server.scheduling import queued_job
from torchrelay.spec import JobSpec


class JobFacts:
    """What a job's spec implies, derived once per process (specs never change after submit)."""

    __slots__ = ("seq", "spec", "_queued", "_environment", "_job_variables", "_argv")

    def __init__(self, seq: int, spec: JobSpec, queued: policy.QueuedJob | None = None):
        self.seq, self.spec = seq, spec
        self._queued = queued
        self._environment: WorkerEnvironment | None = None
        self._job_variables: dict[str, str] | None = None
        self._argv: list[str] | None = None

    @property
    def queued(self) -> policy.QueuedJob:
        """The policy's view of the job while it waits."""
        if self._queued is None:
            self._queued = queued_job(self.seq, self.spec)
        return self._queued

    @property
    def environment(self) -> WorkerEnvironment:
        if self._environment is None:
            self._environment = WorkerEnvironment.of_spec(self.spec)
        return self._environment

    def worker_env(self, gpus_per_worker: int, node_gpu_type: str | None) -> dict[str, str]:
        """The variables of one launch's workers (``WorkerEnvironment``)."""
        if self._job_variables is None:
            self._job_variables = self.environment.job_variables()
        return self.environment.granted(gpus_per_worker, node_gpu_type).variables(self._job_variables)

    def argv(self) -> list[str]:
        if self._argv is None:
            self._argv = self.spec.argv
        return list(self._argv)


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """Every node as the policy sees it, and their names and GPU types."""

    views: tuple[policy.NodeView, ...]
    names: dict[str, str]
    gpu_types: dict[str, str | None]

    @property
    def ready(self) -> tuple[policy.NodeView, ...]:
        return tuple(n for n in self.views if n.ready)


class Cache:
    """The per-process memo of what rows imply (see the module docstring)."""

    def __init__(self) -> None:
        self.jobs: dict[int, JobFacts] = {}
        self._nodes: NodeFacts | None = None
        self._generation = 0
        self._lock = threading.Lock()

    def nodes(self, load: Callable[[], NodeFacts]) -> NodeFacts:
        facts = self._nodes
        if facts is None:
            generation = self._generation
            facts = load()
            with self._lock:
                if generation == self._generation:
                    self._nodes = facts
        return facts

    def drop_nodes(self) -> None:
        with self._lock:
            self._generation += 1
            self._nodes = None
