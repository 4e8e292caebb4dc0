"""What Slurm says of the executor's jobs, and what the platform makes of it. Pure.

- ``SQUEUE_FORMAT`` / ``parse_squeue``: ``squeue -h -t all -j IDS -O SQUEUE_FORMAT`` text (not
  ``--json``: in 22.05 it ignored ``-j`` and gave exit codes as raw wait statuses) as
  ``{job id: SlurmJob}``, a heterogeneous job once under its leader's id (``-j LEADER`` lists
  every component under its own id, ``HetJobID`` the leader's);
- ``SACCT_FORMAT`` / ``parse_sacct``: ``sacct -n -P -X -j IDS -o SACCT_FORMAT`` likewise;
- ``parse_jobcomp``: the lines of a ``jobcomp/filetxt`` log (``JobId=.. JobState=..``), where
  accounting is off and a job has left ``squeue``;
- ``decide_attempt(AttemptView)``: one attempt (one Slurm job, or one run of it) → an
  ``AttemptDecision``: the status each launch reports, and whether the job was cancelled
  outside torchrelay, requeued (preempted: Slurm holds the job again, and the executor adopts
  it as the next attempt), or is to fail without a restart (its time limit).

How each Slurm end maps to the platform's own reasons and restart rules (``OUTCOMES``):

=============  ===================================================  ===============
Slurm state    platform reason                                       restart
=============  ===================================================  ===============
PREEMPTED      preempted (requeued: back to QUEUED)                  not counted
requeued       preempted (RestartCnt above the attempt's: adopted)      not counted
NODE_FAIL      a node was lost (like an agent's LOST node)           not counted
BOOT_FAIL      a node failed to boot                                 not counted
TIMEOUT        ran past its time limit (like ``max_runtime_s``)      none: FAILED
DEADLINE       passed its deadline                                   none: FAILED
OUT_OF_MEMORY  a rank ran out of memory                              counted
FAILED         the batch job failed before its ranks reported        counted
COMPLETED      (without an exit record: the launch vanished)          counted
CANCELLED      cancelled (``scancel`` from outside: job CANCELLED)   none
=============  ===================================================  ===============

A launch's own exit record (written on its node by the agent's launcher) is the truth about
its ranks and wins over the table, except a record of a launch killed by a signal it was not
asked for by torchrelay: that waits for Slurm's state to say why (a ``scancel`` outside, a
requeue, a time limit). A record of a checkpoint-and-stop (``SIGUSR1``, the ``--signal=B:USR1@N``
warning before the time limit) is a restart that does not count.

No I/O, no clock.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from torchrelay.wire import LaunchStatus

SQUEUE_FORMAT = "JobID:|,State:|,Reason:|,RestartCnt:|,HetJobID:|"  # for -O: "|" ends each field, no padding
SACCT_FORMAT = "JobIDRaw,State,ExitCode"

PENDING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
                            "SPECIAL_EXIT", "RESV_DEL_HOLD"})
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "STOPPED", "SUSPENDED"})


class Rule(str, enum.Enum):
    REQUEUE = "requeue"  # back to QUEUED, not counted (the platform's preemption)
    FREE = "free"  # restart not counted (the platform's lost node)
    COUNTED = "counted"  # restart counted against max_restarts
    FAIL = "fail"  # FAILED, no restart (the platform's runtime overrun)
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Outcome:
    reason: str
    rule: Rule


OUTCOMES: Mapping[str, Outcome] = {
    "PREEMPTED": Outcome("preempted by Slurm", Rule.REQUEUE),
    "NODE_FAIL": Outcome("a Slurm node failed (NODE_FAIL)", Rule.FREE),
    "BOOT_FAIL": Outcome("a Slurm node failed to boot (BOOT_FAIL)", Rule.FREE),
    "TIMEOUT": Outcome("ran past its Slurm time limit (TIMEOUT)", Rule.FAIL),
    "DEADLINE": Outcome("passed its Slurm deadline (DEADLINE)", Rule.FAIL),
    "OUT_OF_MEMORY": Outcome("ran out of memory (Slurm OUT_OF_MEMORY)", Rule.COUNTED),
    "FAILED": Outcome("the Slurm batch job failed", Rule.COUNTED),
    "COMPLETED": Outcome("the Slurm job ended but the launch left no exit record", Rule.COUNTED),
    "CANCELLED": Outcome("cancelled in Slurm (scancel outside torchrelay)", Rule.CANCELLED),
    "REVOKED": Outcome("revoked by Slurm (REVOKED)", Rule.FREE),
}
REQUEUED = Outcome("preempted: Slurm requeued the job", Rule.REQUEUE)
UNKNOWN = Outcome("Slurm no longer knows the job", Rule.FREE)


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """One Slurm job as a status call saw it. ``exit_code``: ``ExitCode``'s first half, when
    known; ``restarts``: how often Slurm requeued it (``RestartCnt``)."""

    job_id: str
    state: str
    reason: str = ""
    exit_code: int | None = None
    restarts: int = 0

    @property
    def pending(self) -> bool:
        return self.state in PENDING_STATES

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES

    @property
    def ended(self) -> bool:
        return not (self.pending or self.running)


def _state(text: str) -> str:
    """``CANCELLED by 0`` -> ``CANCELLED``; ``OUT_OF_ME+`` stays (a truncated column is not ours)."""
    return text.strip().split(" ")[0].upper()


def _exit_code(text: str) -> int | None:
    head = text.strip().split(":")[0]
    return int(head) if head.isdigit() else None


def leader_id(job_id: str) -> str:
    """A heterogeneous job's id from one component's (``123+1`` -> ``123``); others unchanged."""
    return job_id.split("+", 1)[0]


def _merged(first: SlurmJob, other: SlurmJob) -> SlurmJob:
    """Two components of one heterogeneous job as one: running while any runs, else component
    0's state (the first seen); the most requeues either had."""
    shown = other if other.running and not first.running else first
    return SlurmJob(first.job_id, shown.state, shown.reason, first.exit_code, max(first.restarts, other.restarts))


def parse_squeue(text: str) -> dict[str, SlurmJob]:
    """By job id. A heterogeneous job's components (squeue lists each under its own id, with
    the leader's as ``HetJobID``) as one job under the leader's id."""
    rows: dict[str, list[SlurmJob]] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.strip().split("|")]
        if len(fields) >= 2 and fields[0]:
            restarts = fields[3] if len(fields) > 3 else ""
            het = fields[4] if len(fields) > 4 else ""
            job_id = het if het.isdigit() else fields[0]
            job = SlurmJob(job_id, _state(fields[1]), fields[2] if len(fields) > 2 else "",
                           restarts=int(restarts) if restarts.isdigit() else 0)
            parts = rows.setdefault(job_id, [])
            if fields[0] == job_id:  # the leader (or a job of one component) first
                parts.insert(0, job)
            else:
                parts.append(job)
    out = {}
    for job_id, parts in rows.items():
        job = parts[0]
        for other in parts[1:]:
            job = _merged(job, other)
        out[job_id] = job
    return out


def parse_sacct(text: str) -> dict[str, SlurmJob]:
    out = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) >= 3 and fields[0].isdigit():
            out[fields[0]] = SlurmJob(fields[0], _state(fields[1]), exit_code=_exit_code(fields[2]))
    return out


_FIELD = re.compile(r"(\w+)=(\S*)")


def parse_jobcomp(text: str, wanted: set[str] | None = None) -> dict[str, SlurmJob]:
    """The jobs of a ``jobcomp/filetxt`` log (the last line of a job wins: a requeued job is
    logged at each end); ``wanted``: keep only these ids."""
    out = {}
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        job_id = fields.get("JobId")
        if job_id and (wanted is None or job_id in wanted) and "JobState" in fields:
            out[job_id] = SlurmJob(job_id, _state(fields["JobState"]), exit_code=_exit_code(fields.get("ExitCode", "")))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ExitRecord:
    """A launch's exit as its node's launcher recorded it: the agent's ``LaunchStatus`` and the
    signal that made the launcher stop its workers, if one did (``SIGTERM``, ``SIGUSR1``)."""

    status: LaunchStatus
    signalled: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchFacts:
    """One launch of the attempt as the server holds it."""

    node_rank: int
    state: str  # LaunchState value
    desired: str  # "run" | "stop"
    record: ExitRecord | None = None
    started: bool = False  # its launcher made its node folder: it runs, whatever the last poll said


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptView:
    """One attempt: its Slurm job as the last status call saw it (None: not seen), whether
    that call failed (``unreachable``), how many calls in a row have not found the job
    (``missing_polls``) and its launches."""

    slurm: SlurmJob | None
    launches: tuple[LaunchFacts, ...]
    unreachable: bool = False
    missing_polls: int = 0
    restarts: int = 0  # the RestartCnt this attempt runs as (an adopted run of a requeued job: above 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptDecision:
    """``reports``: (node_rank, status, infra) to apply in order; ``rule``: a job-level
    outcome to carry out first (REQUEUE, FAIL or CANCELLED), with ``reason``; ``adopt``: Slurm
    requeued the job and holds it (pending, or running again): its next run is the job's next
    attempt, so it keeps its place in Slurm's queue; ``scancel``: the Slurm job must be
    cancelled (it ended the attempt but Slurm still lists it live)."""

    reports: tuple[tuple[int, LaunchStatus, bool], ...] = ()
    rule: Rule | None = None
    reason: str = ""
    adopt: bool = False
    scancel: bool = False


WAIT = AttemptDecision()
MISSING_POLLS_LIMIT = 3  # status calls in a row that do not find the job before it counts as gone


def _exited(reason: str, *, stopped: bool = False) -> LaunchStatus:
    return LaunchStatus(state="exited", succeeded=False, stopped=stopped, message=reason)


def _record_report(launch: LaunchFacts, slurm: SlurmJob | None) -> tuple[LaunchStatus, bool] | None:
    """The status a launch's exit record gives now, with ``infra``; None to wait for Slurm."""
    record = launch.record
    assert record is not None
    if record.signalled == "SIGUSR1":
        status = record.status.model_copy(update={"succeeded": False, "message": "checkpoint-and-stop before the "
                                                  "Slurm time limit (SIGUSR1); continuing in a new attempt"})
        return status, True
    if record.signalled and launch.desired != "stop" and not (slurm is not None and slurm.ended):
        return None  # killed by a signal torchrelay did not send: Slurm's state will say why
    return record.status, False


def decide_attempt(view: AttemptView) -> AttemptDecision:
    """What the attempt's launches report now (see the module docstring)."""
    live = [x for x in view.launches if x.state != "exited"]
    if not live:
        return WAIT
    slurm = None if view.unreachable else view.slurm
    outcome = _slurm_outcome(view, slurm, live)
    if outcome is not None and outcome.rule in (Rule.CANCELLED, Rule.REQUEUE, Rule.FAIL):
        stopped = outcome.rule == Rule.CANCELLED
        reports = tuple((x.node_rank, _exited(outcome.reason, stopped=stopped), outcome.rule == Rule.REQUEUE)
                        for x in live)
        held = slurm is not None and not slurm.ended
        adopt = held and outcome is REQUEUED
        return AttemptDecision(reports=reports, rule=outcome.rule, reason=outcome.reason, adopt=adopt,
                               scancel=held and not adopt)
    reports = []
    for launch in live:
        if launch.record is not None:
            report = _record_report(launch, slurm)
            if report is not None:
                reports.append((launch.node_rank, *report))
        elif outcome is not None:
            reports.append((launch.node_rank, _exited(outcome.reason, stopped=launch.desired == "stop"),
                            outcome.rule == Rule.FREE))
        elif launch.state == "pending" and (launch.started or (slurm is not None and slurm.running)):
            reports.append((launch.node_rank, LaunchStatus(state="running"), False))
    return AttemptDecision(reports=tuple(reports))


def _slurm_outcome(view: AttemptView, slurm: SlurmJob | None, live: Sequence[LaunchFacts]) -> Outcome | None:
    """What Slurm's state says of the attempt as a whole, or None when it says nothing yet."""
    if view.unreachable:
        return None
    if slurm is None:
        return UNKNOWN if view.missing_polls >= MISSING_POLLS_LIMIT else None
    asked_to_stop = all(x.desired == "stop" for x in live)
    if slurm.restarts > view.restarts and not slurm.ended and not asked_to_stop:  # requeued since it started
        return REQUEUED
    if not slurm.ended:
        return None
    outcome = OUTCOMES.get(slurm.state, Outcome(f"the Slurm job ended {slurm.state}", Rule.COUNTED))
    if outcome.rule == Rule.CANCELLED and asked_to_stop:
        return Outcome("stopped (scancel)", Rule.COUNTED)  # our own stop: the launches' exits as asked
    if outcome.rule == Rule.FAIL and any(x.record is not None and x.record.signalled == "SIGUSR1" for x in live):
        return None  # it checkpointed and stopped before the limit: the records say so
    if outcome.rule == Rule.COUNTED and slurm.exit_code:
        return Outcome(f"{outcome.reason} (exit code {slurm.exit_code})", outcome.rule)
    return outcome
