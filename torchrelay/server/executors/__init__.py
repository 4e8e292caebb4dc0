"""Executors: what places a job's attempts. The server's agents are one; Slurm is the second.

A job names its executor in its spec (``executor``, default ``agents``). The ``Executor``
interface keeps the pure parts apart from the effects, as torchx's ``Scheduler`` keeps
``submit_dryrun`` apart from ``schedule``:

- ``check(spec)``: refuse at submit a job that can never run there (``Unschedulable`` naming
  the limits). No effects beyond what the executor caches of its cluster.
- ``dryrun(spec, job_id)``: what it would submit for the job's first attempt, as text (the
  agents: nothing beyond the spec; Slurm: the batch script). No effects.
- ``start()`` / ``stop()`` / ``kick()``: the executor's own loop (placing its queued jobs,
  polling their state, tailing their logs), which reports through the service's own methods.

``Executors`` is the server's set of them by name; ``AGENTS`` is the agents' name. The agents'
placement is the scheduling cycle in ``control.py`` over the nodes that agents registered;
an executor that registers a node of its own (Slurm's partition, so that its launches have a
node) marks it with ``EXECUTOR_LABEL`` and the agents' cycle leaves it alone
(``agents_only``).
"""
from __future__ import annotations

import abc
from typing import Any, Iterable, Mapping

from torchrelay import scheduler as policy
from torchrelay.errors import InvalidSpec
from torchrelay.spec import DEFAULT_EXECUTOR, JobSpec

AGENTS = DEFAULT_EXECUTOR
EXECUTOR_LABEL = "torchrelay.executor"


class Executor(abc.ABC):
    """One way of placing jobs (see the module docstring)."""

    name: str

    @abc.abstractmethod
    def check(self, spec: JobSpec) -> None:
        """Raise ``Unschedulable`` when ``spec`` can never run here. Does not block long."""

    @abc.abstractmethod
    def dryrun(self, spec: JobSpec, job_id: str) -> str | None:
        """What this executor would submit for ``spec``'s first attempt; None: nothing but the spec."""

    def attach(self, host: Any) -> None:
        """Given the service it serves (its database, control, store and ingest methods)."""

    def start(self) -> None:
        """Start the executor's own loop, if it has one. Idempotent."""

    def stop(self) -> None:
        """End the loop; idempotent."""

    def kick(self) -> None:
        """Something changed (a job queued, a launch told to stop): act soon. Does not block."""


class AgentsExecutor(Executor):
    """The server's own agents: placement is ``control.py``'s scheduling cycle, and a job that
    could never fit the ready nodes is refused where submissions are written (it needs them)."""

    name = AGENTS

    def check(self, spec: JobSpec) -> None:
        return None

    def dryrun(self, spec: JobSpec, job_id: str) -> str | None:
        return None


class Executors:
    """The server's executors by name; the agents are always one."""

    def __init__(self, extra: Iterable[Executor] = ()):
        self.by_name: dict[str, Executor] = {AGENTS: AgentsExecutor()}
        for executor in extra:
            if executor.name in self.by_name:
                raise InvalidSpec(f"executor name {executor.name!r} is used twice; give each its own name")
            self.by_name[executor.name] = executor

    def of(self, spec: JobSpec) -> Executor:
        """The job's executor. Raises ``InvalidSpec`` naming the ones this server has."""
        found = self.by_name.get(spec.executor)
        if found is None:
            raise InvalidSpec(f"executor: {spec.executor!r} is not one of this server's executors "
                              f"({', '.join(sorted(self.by_name))}); start the server with it, or drop `executor`")
        return found

    def check(self, spec: JobSpec) -> None:
        """Raises ``InvalidSpec`` (unknown executor) or ``Unschedulable`` (never fits there)."""
        self.of(spec).check(spec)

    def dryrun(self, spec: JobSpec, job_id: str) -> dict[str, Any]:
        """What submitting ``spec`` would do: ``{"executor", "spec", "submission"}`` (the
        executor's text, e.g. Slurm's batch script; None for the agents). Raises as ``check``."""
        executor = self.of(spec)
        executor.check(spec)
        return {"executor": executor.name, "spec": spec.to_public(), "submission": executor.dryrun(spec, job_id)}

    @property
    def others(self) -> list[Executor]:
        return [x for name, x in self.by_name.items() if name != AGENTS]

    def attach(self, host: Any) -> None:
        for executor in self.others:
            executor.attach(host)

    def start(self) -> None:
        for executor in self.others:
            executor.start()

    def stop(self) -> None:
        for executor in self.others:
            executor.stop()

    def kick(self) -> None:
        for executor in self.others:
            executor.kick()


def agents_only(nodes: Iterable[policy.NodeView]) -> tuple[policy.NodeView, ...]:
    """The nodes the agents' scheduling cycle places on: not an executor's own."""
    return tuple(n for n in nodes if not any(key == EXECUTOR_LABEL for key, _ in n.labels))


def is_agents_job(spec: JobSpec) -> bool:
    return spec.executor == AGENTS


def executor_labels(name: str) -> Mapping[str, str]:
    return {EXECUTOR_LABEL: name}
