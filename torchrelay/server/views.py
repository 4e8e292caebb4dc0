"""What the server's decision modules see of its rows: small frozen values, no I/O.

``rows.py`` builds these from the database; ``lifecycle``, ``failures`` and ``watchdogs``
decide from them alone, so each rule is a function of plain values (time is an argument) and
is tested by tables of cases with no database and no processes.

- ``JobView``: a job's state and restart bookkeeping; ``LaunchView``: one launch of its current
  attempt, as its agent last reported it;
- ``StopKind``: why the server asked a launch to stop (stored beside the reason it shows);
- ``Stop``: a request to stop an attempt's live launches;
- ``NodeLiveness``, ``ProgressView``, ``RuntimeView``: what the watchdogs read;
- ``job_id_of`` / ``job_seq_of``: a job's public id from its row's sequence number and back.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

from torchrelay.spec import JobState, LaunchState, NodeState
from torchrelay.wire import FailureInfo


def job_id_of(seq: int) -> str:
    return f"job-{seq}"


def job_seq_of(job_id: str) -> int | None:
    """``job-12`` or ``12`` -> 12; anything else (other digits than ASCII ones, a number past what
    the state store's 64-bit keys hold) -> None."""
    text = job_id.removeprefix("job-")
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


class StopKind(str, enum.Enum):
    """Why the server asked a launch to stop. ``RUNTIME`` decides how the attempt ends (FAILED,
    never restarted); the others only say why."""

    CANCEL = "cancel"
    PREEMPT = "preempt"
    ATTEMPT_FAILED = "attempt_failed"
    HANG = "hang"
    RUNTIME = "runtime"


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    """Stop the attempt's launches that still run, telling their agents ``reason``."""

    kind: StopKind
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobView:
    """A job as the lifecycle decides on it. ``hung_failure`` is set when the current attempt
    was stopped as hung: that failure, not a rank's exit, explains it."""

    id: str
    state: JobState
    attempt: int
    restarts: int = 0
    max_restarts: int = 0
    requeue: bool = False
    hung_failure: FailureInfo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchView:
    """One launch as its agent last reported it. ``ranks`` are ``wire.RankExit`` dicts (parsed
    only when a failure is blamed); ``infra``: it failed for a reason outside the job (its node
    was lost); ``stopped``: it exited because the server asked it to."""

    id: str
    attempt: int
    node_id: str
    node_rank: int
    state: LaunchState
    node_name: str | None = None
    desired: str = "run"
    stop_kind: StopKind | None = None
    stop_reason: str | None = None
    succeeded: bool | None = None
    stopped: bool = False
    infra: bool = False
    message: str = ""
    ranks: tuple[Mapping[str, Any], ...] = ()

    @property
    def exited(self) -> bool:
        return self.state == LaunchState.EXITED

    @property
    def failed(self) -> bool:
        return self.exited and not self.succeeded


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLiveness:
    """A node's last heartbeat (server time)."""

    id: str
    name: str
    state: NodeState
    last_seen: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgressView:
    """A RUNNING job's last metric (server time; None before the attempt's first one)."""

    seq: int
    attempt: int
    last_progress_at: float | None
    hang_timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeView:
    """An active job that declares ``max_runtime_s``. ``placed_at``: when its current attempt
    was placed (None before any); ``stoppable``: some launch of it still runs and was not yet
    told to stop."""

    seq: int
    attempt: int
    max_runtime_s: float
    placed_at: float | None
    requeue: bool
    stoppable: bool
