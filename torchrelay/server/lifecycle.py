"""The job lifecycle: from what a job's launches report to the job's next states. Pure.

- ``decide(job, launches)``: the ``JobDecision`` for a job given its current attempt's
  launches: the states it goes through (``torchrelay.spec.TRANSITIONS`` order), the failure it
  records, the launches it stops, a restart to book. Idempotent: asked again about the same
  views once the decision is carried out, it decides nothing new.
- ``cancel(state, ...)`` and ``preemption(state)``: what a cancel request and a preemption do.
- ``launch_update(current, reported)``: the state an agent's report moves a launch to (None
  for a stale report); ``stopped_by_server``: whether an exit counts as the server's stop.

Job life: placed -> SCHEDULED; a launch running -> RUNNING; every launch succeeded ->
SUCCEEDED. A failed launch stops the attempt's others at once; once all have exited the job
restarts (RESTARTING, placed again like a queued job) or fails (``failures.decide_failure``).
A cancelled job ends CANCELLED, a preempted one goes back to QUEUED, one stopped at its
``max_runtime_s`` ends FAILED, each once its launches have exited.

No I/O, no clock; the server applies a decision in one transaction (``control.py``). A
transition to the state the job is already in is a no-op there (no event).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torchrelay.server.failures import FailureAction, FailureDecision, blame, decide_failure, outside_the_job
from torchrelay.server.views import JobView, LaunchView, Stop, StopKind
from torchrelay.spec import JobState, LaunchState, can_launch_transition
from torchrelay.wire import FailureInfo

_S = JobState


@dataclass(frozen=True, slots=True)
class Transition:
    """Go to ``state``, recording ``message`` as the job's event."""

    state: JobState
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDecision:
    """What to do to a job, carried out in this order: record ``failure`` (or clear it), clear
    the requeue flag (``requeued``), book ``restart``, stop the live launches (``stop``), then
    go through ``transitions``."""

    transitions: tuple[Transition, ...] = ()
    failure: FailureInfo | None = None
    clears_failure: bool = False
    requeued: bool = False
    restart: FailureDecision | None = None
    stop: Stop | None = None


NOTHING = JobDecision()


def decide(job: JobView, launches: Sequence[LaunchView]) -> JobDecision:
    """The job's next steps from its current attempt's ``launches`` (empty: none placed)."""
    state = job.state
    if state.terminal or state == _S.QUEUED or not launches:
        return NOTHING
    steps: tuple[Transition, ...] = ()
    all_exited = all(x.exited for x in launches)
    if state in (_S.SCHEDULED, _S.RESTARTING) and any(x.state == LaunchState.RUNNING for x in launches):
        steps = (Transition(_S.RUNNING, f"attempt {job.attempt} running"),)
        state = _S.RUNNING
    if state == _S.CANCELLING:
        return JobDecision(transitions=steps + _once(all_exited, _S.CANCELLED, "all workers stopped"))
    if job.requeue:
        return JobDecision(transitions=steps + _once(all_exited, _S.QUEUED, "requeued after preemption"),
                           requeued=all_exited)
    overtime = next((x.stop_reason or "" for x in launches if x.stop_kind == StopKind.RUNTIME), None)
    if overtime is not None:
        if not all_exited:
            return JobDecision(transitions=steps)
        return JobDecision(transitions=steps + (Transition(_S.FAILED, overtime),),
                           failure=FailureInfo(reason=overtime, attempt=job.attempt))
    failed = [x for x in launches if x.failed]
    if failed:
        return _after_failure(job, failed, steps, all_exited)
    if all_exited and all(x.succeeded for x in launches):
        started = (Transition(_S.RUNNING, "started"),) if state == _S.SCHEDULED else ()
        return JobDecision(transitions=steps + started + (Transition(_S.SUCCEEDED, "every rank finished"),),
                           clears_failure=True)
    return JobDecision(transitions=steps)


def _once(ready: bool, state: JobState, message: str) -> tuple[Transition, ...]:
    return (Transition(state, message),) if ready else ()


def _after_failure(job: JobView, failed: list[LaunchView], steps: tuple[Transition, ...],
                   all_exited: bool) -> JobDecision:
    """A launch failed: stop the others; once all have exited, restart or fail."""
    failure = job.hung_failure or blame(failed, job.attempt)
    if not all_exited:
        return JobDecision(transitions=steps, failure=failure,
                           stop=Stop(kind=StopKind.ATTEMPT_FAILED, reason=f"attempt {job.attempt} failed: "
                                     f"{failure.reason}"))
    verdict = decide_failure(failure, infra_only=outside_the_job(failed), restarts=job.restarts,
                             max_restarts=job.max_restarts)
    if verdict.action == FailureAction.RESTART:
        return JobDecision(transitions=steps + (Transition(_S.RESTARTING, verdict.message),), failure=failure,
                           restart=verdict)
    return JobDecision(transitions=steps + (Transition(_S.FAILED, verdict.message),), failure=failure)


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelDecision:
    """What a cancel request does: ``transitions``, then ``stop`` the live launches; with
    ``kill_at_once`` they get no grace (SIGKILL right after SIGTERM). Nothing for a job that
    finished or is already being cancelled (a cancel is idempotent)."""

    transitions: tuple[Transition, ...] = ()
    stop: Stop | None = None
    kill_at_once: bool = False


def cancel(state: JobState, *, has_live_launches: bool, checkpoint: bool) -> CancelDecision:
    """Cancel a job in ``state``. ``checkpoint``: give the workers their ``stop_grace_s`` to
    commit a checkpoint; else kill them at once."""
    if state == _S.QUEUED:
        return CancelDecision(transitions=(Transition(_S.CANCELLED, "cancelled by user"),))
    if state == _S.RESTARTING and not has_live_launches:
        return CancelDecision(transitions=(Transition(_S.CANCELLING, "cancelled by user"),
                                           Transition(_S.CANCELLED, "no process was running")))
    if state.active and state != _S.CANCELLING:
        message = "cancel requested" + ("" if checkpoint else " (no checkpoint: workers killed at once)")
        return CancelDecision(transitions=(Transition(_S.CANCELLING, message),),
                              stop=Stop(kind=StopKind.CANCEL, reason="job cancelled"), kill_at_once=not checkpoint)
    return CancelDecision()


def preemption(state: JobState) -> Stop | None:
    """The stop a job chosen as a preemption victim gets, or None when it holds nothing to
    give back (not active) or is being cancelled anyway. The job is requeued once stopped."""
    if state.active and state != _S.CANCELLING:
        return Stop(kind=StopKind.PREEMPT, reason="preempted by a higher-priority job")
    return None


def launch_update(current: LaunchState, reported: LaunchState) -> LaunchState | None:
    """The state an agent's report moves a launch to; None when the report is stale (a
    resend of an earlier state, or any report on an exited launch)."""
    return reported if can_launch_transition(current, reported) else None


def stopped_by_server(*, reported_stopped: bool, desired: str, succeeded: bool) -> bool:
    """An exit counts as the server's stop when the agent says so, or when the launch was
    told to stop and did not succeed (its ranks died of the stop's signals)."""
    return reported_stopped or (desired == "stop" and not succeeded)
