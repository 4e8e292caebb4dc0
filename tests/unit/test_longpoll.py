"""The job long-poll (server/longpoll.py) against a change that lands between its read and its wait."""
import asyncio
from types import SimpleNamespace

import pytest

from torchrelay.server import longpoll
from torchrelay.server.notify import Notifier
from torchrelay.spec import JobState

BOUND_S = 10  # the wait asked for is 60 s: a long-poll that misses the change runs into this bound


class JobThatEndsAfterTheFirstRead:
    """A service whose job is RUNNING at the first read, and whose end is committed (and its
    key bumped, as the outbox does after a commit) before that read has returned: the order in
    which the scheduler thread and a request's thread can interleave."""

    def __init__(self, end_at_read: int) -> None:
        self.notifier = Notifier()
        self.state = JobState.RUNNING
        self.reads = 0
        self.end_at_read = end_at_read

    def get_job(self, job_id: str) -> SimpleNamespace:
        self.reads += 1
        seen = SimpleNamespace(id=job_id, state=self.state)
        if self.reads == self.end_at_read:
            self.state = JobState.SUCCEEDED
            self.notifier.bump(f"job:{job_id.removeprefix('job-')}")
        return seen


@pytest.mark.parametrize("end_at_read", [1, 2])
def test_a_job_that_ends_between_the_read_and_the_wait_is_answered_at_once(end_at_read):
    svc = JobThatEndsAfterTheFirstRead(end_at_read)
    info = asyncio.run(asyncio.wait_for(longpoll.job(svc, "job-7", 60, "RUNNING"), BOUND_S))
    assert info.state is JobState.SUCCEEDED


def test_a_job_in_another_state_than_known_is_answered_without_waiting():
    svc = JobThatEndsAfterTheFirstRead(end_at_read=0)
    info = asyncio.run(asyncio.wait_for(longpoll.job(svc, "job-7", 60, "QUEUED"), BOUND_S))
    assert info.state is JobState.RUNNING and svc.reads == 1
