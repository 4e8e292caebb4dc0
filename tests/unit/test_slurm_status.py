"""What Slurm says of a job, and what the platform makes of it: parsers and ``decide_attempt`` (tables)."""
from __future__ import annotations

import pytest

from torchrelay.server.executors.slurm_status import (AttemptView, ExitRecord, LaunchFacts, Rule, SlurmJob,
                                                      decide_attempt, parse_jobcomp, parse_sacct, parse_squeue)
from torchrelay.wire import LaunchStatus, RankExit


def test_squeue_text_gives_a_heterogeneous_job_once_by_its_leaders_id():
    # as 22.05 lists them: each component under its own id, the leader's in HetJobID; N/A for others
    text = ("20|RUNNING|None|1|20|\n21|RUNNING|None|1|20|\n31|RUNNING|None|0|30|\n30|COMPLETING|None|0|30|\n"
            "40|PENDING|BeginTime|2|40|\n41|PENDING|BeginTime|2|40|\n50|RUNNING|None|0|N/A|\n")
    assert parse_squeue(text) == {"20": SlurmJob("20", "RUNNING", "None", restarts=1),
                                  "30": SlurmJob("30", "COMPLETING", "None"),
                                  "40": SlurmJob("40", "PENDING", "BeginTime", restarts=2),
                                  "50": SlurmJob("50", "RUNNING", "None")}
    assert parse_squeue("23|COMPLETED|None|0|23|\n24|RUNNING|None|0|23|\n")["23"].state == "RUNNING"


def test_squeue_text():
    text = "12|RUNNING|None|0\n13|PENDING|BeginTime|1\n14|CANCELLED|None|0\n\n"
    assert parse_squeue(text) == {"12": SlurmJob("12", "RUNNING", "None"),
                                  "13": SlurmJob("13", "PENDING", "BeginTime", restarts=1),
                                  "14": SlurmJob("14", "CANCELLED", "None")}


def test_sacct_text_keeps_the_first_half_of_exit_codes_and_the_state_word():
    text = "12|COMPLETED|0:0\n13|CANCELLED by 0|0:15\n14|FAILED|3:0\n14.batch|FAILED|3:0\n"
    assert parse_sacct(text) == {"12": SlurmJob("12", "COMPLETED", exit_code=0),
                                 "13": SlurmJob("13", "CANCELLED", exit_code=0),
                                 "14": SlurmJob("14", "FAILED", exit_code=3)}


def test_jobcomp_log_last_line_of_a_job_wins():
    text = ("JobId=5 UserId=root(0) Name=relay-job-1-a1 JobState=NODE_FAIL Partition=debug ExitCode=0:9 x=y\n"
            "JobId=6 UserId=root(0) Name=other JobState=COMPLETED ExitCode=0:0\n"
            "JobId=5 UserId=root(0) Name=relay-job-1-a1 JobState=COMPLETED ExitCode=0:0\n")
    assert parse_jobcomp(text, {"5"}) == {"5": SlurmJob("5", "COMPLETED", exit_code=0)}
    assert set(parse_jobcomp(text)) == {"5", "6"}


OK = LaunchStatus(state="exited", succeeded=True, ranks=[RankExit(rank=0, exit_code=0, returned=True)])
FAILED = LaunchStatus(state="exited", succeeded=False, ranks=[RankExit(rank=1, exit_code=3, last_lines=["boom"])])
STOPPED = LaunchStatus(state="exited", succeeded=False, stopped=True, message="stopped")


def _launch(rank=0, state="running", desired="run", record=None, signalled=None):
    return LaunchFacts(node_rank=rank, state=state, desired=desired,
                       record=ExitRecord(status=record, signalled=signalled) if record else None)


def _job(state):
    return SlurmJob("9", state)


# (slurm, launches, expected: rule, [(rank, state, succeeded, infra, message-part)], then: None,
#  "adopt" (the next attempt adopts the requeued Slurm job) or "scancel"), the attempt's RestartCnt
CASES = {
    "pending, not started": (_job("PENDING"), [_launch(state="pending")], None, [], None),
    "running in Slurm: the launches run": (_job("RUNNING"), [_launch(0, "pending"), _launch(1, "pending")], None,
                                           [(0, "running", None, False, ""), (1, "running", None, False, "")], None),
    "a launcher that started runs before squeue says so": (
        _job("PENDING"), [LaunchFacts(node_rank=0, state="pending", desired="run", started=True)], None,
        [(0, "running", None, False, "")], None),
    "exit records are the truth": (_job("RUNNING"), [_launch(0, record=OK), _launch(1, record=FAILED)], None,
                                   [(0, "exited", True, False, ""), (1, "exited", False, False, "")], None),
    "records before squeue says so": (None, [_launch(0, record=OK)], None, [(0, "exited", True, False, "")], None),
    "a signal torchrelay did not send waits for Slurm": (
        _job("RUNNING"), [_launch(0, record=STOPPED, signalled="SIGTERM")], None, [], None),
    "our own stop's record is taken at once": (
        _job("RUNNING"), [_launch(0, desired="stop", record=STOPPED, signalled="SIGTERM")], None,
        [(0, "exited", False, False, "stopped")], None),
    "scancel outside torchrelay: cancelled": (
        _job("CANCELLED"), [_launch(0, record=STOPPED, signalled="SIGTERM"), _launch(1)], Rule.CANCELLED,
        [(0, "exited", False, False, "scancel outside"), (1, "exited", False, False, "scancel outside")], None),
    "our own scancel: the launches' exits as asked": (
        _job("CANCELLED"), [_launch(0, desired="stop")], None, [(0, "exited", False, False, "stopped (scancel)")],
        False),
    "requeued (preempted) while running: requeue, the next attempt adopts the Slurm job": (
        SlurmJob("9", "PENDING", restarts=1), [_launch(0, record=STOPPED, signalled="SIGTERM"), _launch(1)],
        Rule.REQUEUE, [(0, "exited", False, True, "requeued"), (1, "exited", False, True, "requeued")], "adopt"),
    "pending as last seen while the launcher already started: no requeue": (
        _job("PENDING"), [_launch(0, state="running")], None, [], None),
    "PREEMPTED": (_job("PREEMPTED"), [_launch(0)], Rule.REQUEUE, [(0, "exited", False, True, "preempted")], None),
    "NODE_FAIL: a free restart": (_job("NODE_FAIL"), [_launch(0), _launch(1, record=OK)], None,
                                  [(0, "exited", False, True, "NODE_FAIL"), (1, "exited", True, False, "")], None),
    "TIMEOUT: failed, no restart": (_job("TIMEOUT"), [_launch(0)], Rule.FAIL,
                                    [(0, "exited", False, False, "time limit")], None),
    "checkpoint-and-stop on SIGUSR1 then TIMEOUT: a free restart": (
        _job("TIMEOUT"), [_launch(0, record=STOPPED, signalled="SIGUSR1")], None,
        [(0, "exited", False, True, "SIGUSR1")], None),
    "checkpoint-and-stop on SIGUSR1 while still running": (
        _job("RUNNING"), [_launch(0, record=STOPPED, signalled="SIGUSR1")], None,
        [(0, "exited", False, True, "checkpoint-and-stop")], None),
    "OUT_OF_MEMORY: counted": (_job("OUT_OF_MEMORY"), [_launch(0)], None,
                               [(0, "exited", False, False, "out of memory")], None),
    "FAILED without records names the exit code": (
        SlurmJob("9", "FAILED", exit_code=2), [_launch(0)], None, [(0, "exited", False, False, "exit code 2")], None),
    "requeued again while an adopted run: requeue, adopt again": (
        SlurmJob("9", "RUNNING", restarts=2), [_launch(0)], Rule.REQUEUE, [(0, "exited", False, True, "requeued")],
        "adopt", 1),
    "an adopted run of a requeued job runs: no requeue": (
        SlurmJob("9", "RUNNING", restarts=1), [_launch(0, state="pending")], None, [(0, "running", None, False, "")],
        None, 1),
    "requeued, then ended before it was adopted: nothing to adopt": (
        SlurmJob("9", "CANCELLED", restarts=1), [_launch(0)], Rule.CANCELLED,
        [(0, "exited", False, False, "scancel outside")], None),
    "exited launches are left alone": (_job("COMPLETED"), [_launch(0, state="exited")], None, [], None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decide_attempt(name):
    slurm, launches, rule, reports, then, *restarts = CASES[name]
    decision = decide_attempt(AttemptView(slurm=slurm, launches=tuple(launches), restarts=sum(restarts)))
    assert decision.rule == rule
    assert (decision.adopt, decision.scancel) == (then == "adopt", then == "scancel")
    got = [(rank, s.state, s.succeeded, infra) for rank, s, infra in decision.reports]
    assert got == [r[:4] for r in reports]
    for (_, status, _), expected in zip(decision.reports, reports):
        assert expected[4] in status.message, (status.message, expected[4])


def test_unreachable_controller_changes_nothing_but_records():
    launches = (_launch(0, record=OK), _launch(1))
    decision = decide_attempt(AttemptView(slurm=_job("CANCELLED"), launches=launches, unreachable=True))
    assert decision.rule is None and [(r, s.state) for r, s, _ in decision.reports] == [(0, "exited")]


@pytest.mark.parametrize("missing, reported", [(1, False), (2, False), (3, True)])
def test_a_job_slurm_forgot_counts_as_gone_after_some_polls(missing, reported):
    decision = decide_attempt(AttemptView(slurm=None, launches=(_launch(0),), missing_polls=missing))
    assert bool(decision.reports) == reported
    if reported:
        _, status, infra = decision.reports[0]
        assert infra and "no longer knows" in status.message
