"""The control loop's deadlines: lost nodes, hung jobs, runtime overruns, forgotten launches. Pure.

Each function takes views and the server time ``now`` and returns what to do; the server
carries it out (``control.py``):

- ``lost_nodes``: READY nodes whose last heartbeat is older than the timeout -> ``LostNode``
  (the node becomes LOST; its launches exit as failures outside the job, not counted);
- ``hung_jobs``: RUNNING jobs whose metrics stopped for their ``hang_timeout_s`` -> ``Hang``
  (the attempt is failed with that reason and stopped, and restarts as any failure does);
- ``overruns``: attempts holding their nodes past ``max_runtime_s``, counted from placement
  -> ``Stop`` per job (the job ends FAILED once stopped, never restarted: ``lifecycle``);
- ``forgotten_launches``: launches an agent had acknowledged and no longer reports (the agent
  restarted): they are failed;
- ``checks_due``: whether the time-based checks run in this cycle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from torchrelay.server.views import NodeLiveness, ProgressView, RuntimeView, Stop, StopKind
from torchrelay.spec import LaunchState, NodeState
from torchrelay.wire import FailureInfo


def checks_due(now: float, last_run: float, interval_s: float) -> bool:
    """The checks only find something once the clock has passed a deadline (a heartbeat, a
    metric, a placement), so while cycles come every few tens of ms they run at most every
    ``interval_s``; a clock set back runs them at once."""
    return not 0 <= now - last_run < interval_s


@dataclass(frozen=True, slots=True, kw_only=True)
class LostNode:
    node_id: str
    message: str  # what each of its launches is failed with


def lost_nodes(nodes: Iterable[NodeLiveness], *, now: float, timeout_s: float) -> list[LostNode]:
    deadline = now - timeout_s
    return [LostNode(node_id=n.id, message=f"node {n.name} lost (no heartbeat for {timeout_s:g} s)")
            for n in nodes if n.state == NodeState.READY and n.last_seen < deadline]


@dataclass(frozen=True, slots=True, kw_only=True)
class Hang:
    """Stop the job's attempt (``stop``), record ``failure`` as why it failed and ``event``."""

    seq: int
    stop: Stop
    failure: FailureInfo
    event: str


def hung_jobs(jobs: Iterable[ProgressView], *, now: float) -> list[Hang]:
    """Jobs with a metric in this attempt and none for longer than their ``hang_timeout_s``
    (0: never hung). A job that has not reported any metric yet is never counted as hung."""
    out = []
    for job in jobs:
        timeout = job.hang_timeout_s
        if not timeout or job.last_progress_at is None or now - job.last_progress_at <= timeout:
            continue
        reason = f"no progress for {timeout:g} s (hung worker?)"
        out.append(Hang(seq=job.seq, stop=Stop(kind=StopKind.HANG, reason=reason),
                        failure=FailureInfo(reason=reason, attempt=job.attempt),
                        event=f"no metric for {timeout:g} s: stopping attempt {job.attempt}"))
    return out


def overruns(jobs: Iterable[RuntimeView], *, now: float) -> list[tuple[int, Stop]]:
    """(job seq, stop) for each attempt that has held its nodes longer than ``max_runtime_s``
    since it was placed and still has launches to stop. A job being requeued is left alone."""
    out = []
    for job in jobs:
        if job.requeue or job.placed_at is None or not job.stoppable:
            continue
        ran = now - job.placed_at
        if ran <= job.max_runtime_s:
            continue
        reason = f"ran past max_runtime_s={job.max_runtime_s:g} s (attempt {job.attempt} ran {ran:.0f} s)"
        out.append((job.seq, Stop(kind=StopKind.RUNTIME, reason=reason)))
    return out


def forgotten_launches(live: Sequence[tuple[str, LaunchState]], reported: set[str]) -> list[str]:
    """Ids of the ``live`` (id, state) launches that the agent had acknowledged (preparing or
    running) but no longer lists among its launches: they were lost with the agent."""
    acknowledged = (LaunchState.PREPARING, LaunchState.RUNNING)
    return [launch_id for launch_id, state in live if state in acknowledged and launch_id not in reported]
