"""Job submissions and their group commit.

A submission is validated where it arrives (no I/O, tens of microseconds) into a ``Ticket``,
then waits in ``Submissions``' pending list. Whoever gets the writer lock first writes every
pending ticket in one transaction: one multi-row insert for the jobs and one for their events
(group commit, like PostgreSQL's ``commit_delay``), so concurrent requests share a commit.
``submit`` (any thread) joins the group and blocks until its ticket is written;
``submit_async`` (an event loop) hands the write to one writer thread and is resolved on its
loop, with one wake-up per loop for the whole group. Either returns once its job is committed,
and each ticket gets its own JobInfo or its own error (a job that can never fit the ready
nodes is refused alone).
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from torchrelay import scheduler as policy
from torchrelay.errors import InvalidSpec, NotFound, Unschedulable
from torchrelay.server.executors import Executors, agents_only, is_agents_job
from torchrelay.server.rows import Database, JobFacts
from torchrelay.server.scheduling import never_fits_message, queued_job, submission_probe
from torchrelay.server.views import job_id_of
from torchrelay.spec import JobSpec, JobState
from torchrelay.storage import ArtifactStore
from torchrelay.wire import JobEvent, JobInfo


@dataclass(slots=True)
class Ticket:
    """A validated submission waiting to be written; ``info`` or ``error`` once ``done``.

    ``future`` (with its ``loop``) is set for ``submit_async`` callers: it is resolved on that
    loop once the ticket is done."""

    spec: JobSpec
    public: dict[str, Any]
    bundle: str | None
    probe: policy.QueuedJob
    done: bool = False
    info: JobInfo | None = None
    error: BaseException | None = None
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None


class Submissions:
    """The pending tickets and the writer thread of one service (see the module docstring)."""

    def __init__(self, db: Database, store: ArtifactStore, clock: Callable[[], float],
                 executors: Executors | None = None):
        self.db, self.store, self.clock = db, store, clock
        self.executors = executors or Executors()
        self._pending: list[Ticket] = []
        self._pending_lock = threading.Lock()
        self._flush_queued = False  # a write of ``_pending`` is queued on ``_writer`` (under _pending_lock)
        self._writer: ThreadPoolExecutor | None = None  # one thread: writes for ``submit_async``

    def submit(self, spec_data: dict[str, Any], bundle: str | None, user: str | None) -> JobInfo:
        """Validate and queue a job; returns once it is committed. Blocks (the write); any
        thread. Raises InvalidSpec, NotFound (bundle), Unschedulable."""
        ticket = self.validated(spec_data, bundle, user)
        self.check_bundle(bundle)
        with self._pending_lock:
            self._pending.append(ticket)
        with self.db.lock:  # group commit: the first to get the lock writes every pending submission
            if not ticket.done:
                self._write_pending()
        if ticket.error is not None:
            raise ticket.error
        assert ticket.info is not None
        return ticket.info

    async def submit_async(self, spec_data: dict[str, Any], bundle: str | None, user: str | None) -> JobInfo:
        """``submit`` for an event loop: the same contract, and the loop is never blocked."""
        ticket = self.validated(spec_data, bundle, user)
        if bundle is not None:
            await asyncio.to_thread(self.check_bundle, bundle)  # the store may be remote
        ticket.loop = asyncio.get_running_loop()
        ticket.future = ticket.loop.create_future()
        with self._pending_lock:
            self._pending.append(ticket)
            if not self._flush_queued:
                if self._writer is None:
                    self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-submit-writer")
                self._writer.submit(self._flush)
                self._flush_queued = True
        return await ticket.future

    def close(self) -> None:
        """Write what was accepted for writing, then end the writer thread. Idempotent."""
        with self._pending_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)

    def validated(self, spec_data: dict[str, Any], bundle: str | None, user: str | None) -> Ticket:
        """The submission as a ticket ready to write. No I/O (an executor checks against what it
        cached of its cluster). Raises InvalidSpec, Unschedulable."""
        spec = JobSpec.parse(spec_data)
        if spec.user is None and user:
            spec = spec.model_copy(update={"user": user})
        probe = queued_job(0, spec)
        problem = policy.job_problem(probe)
        if problem:
            raise InvalidSpec(f"job {spec.name!r}: {problem}")
        self.executors.check(spec)
        return Ticket(spec=spec, public=spec.to_public(), bundle=bundle, probe=probe)

    def check_bundle(self, bundle: str | None) -> None:
        if bundle is not None and not self.store.exists(ArtifactStore.bundle_key(bundle)):
            raise NotFound(f"bundle {bundle} was not uploaded; POST it to /api/v1/bundles first")

    def _flush(self) -> None:
        """The writer thread's task: write whatever is pending (it may be nothing: a ``submit``
        caller may have written it already)."""
        with self.db.lock:
            self._write_pending()

    def _write_pending(self) -> None:
        """Insert every pending ticket in one transaction (caller holds the writer lock). Each
        ticket gets its JobInfo or its error; waiting ``submit_async`` callers are resolved on
        their loops; one scheduling pass is asked for."""
        with self._pending_lock:
            tickets, self._pending = self._pending, []
            self._flush_queued = False
        if not tickets:
            return
        try:
            self._insert(tickets)
        except BaseException as exc:  # nothing was written: every ticket without its own error gets this one
            for ticket in tickets:
                if ticket.error is None:
                    ticket.info, ticket.error = None, exc
            raise
        finally:
            waiting: dict[asyncio.AbstractEventLoop, list[Ticket]] = {}
            for ticket in tickets:
                ticket.done = True
                if ticket.loop is not None:
                    waiting.setdefault(ticket.loop, []).append(ticket)
            for loop, group in waiting.items():  # one wake-up per loop, not one per request
                try:
                    loop.call_soon_threadsafe(_resolve_futures, group)
                except RuntimeError:  # loop closed at shutdown: nobody waits any more
                    pass

    def _insert(self, tickets: list[Ticket]) -> None:
        now = self.clock()
        with self.db.write() as rows:
            ready = agents_only(rows.nodes().ready)
            good = []
            for ticket in tickets:
                probe = submission_probe(ticket.spec, ticket.probe)
                if ready and is_agents_job(ticket.spec) and not policy.fits_ever(probe, ready):
                    ticket.error = Unschedulable(never_fits_message(ticket.spec, ready))
                else:
                    good.append(ticket)
            seqs = rows.insert_jobs([(t.spec, t.public, t.bundle) for t in good], now) if good else []
            if good:
                rows.outbox.keys.add("jobs")
                rows.outbox.kick = True
        # only once committed: a rolled-back insert's seq may be handed out again
        for ticket, seq in zip(good, seqs):
            self.db.cache.jobs[seq] = JobFacts(seq, ticket.spec, dataclasses.replace(
                ticket.probe, job_id=job_id_of(seq), submit_seq=seq))
            ticket.info = JobInfo(id=job_id_of(seq), name=ticket.spec.name, user=ticket.spec.user,
                                  state=JobState.QUEUED, spec=ticket.public, bundle=ticket.bundle,
                                  priority=ticket.spec.priority, submitted_at=now, attempt=0, restarts=0,
                                  events=[JobEvent(time=now, state=JobState.QUEUED, message="submitted")])


def _resolve_futures(tickets: list[Ticket]) -> None:
    """On the tickets' event loop: hand each waiting ``submit_async`` its JobInfo or error."""
    for ticket in tickets:
        if ticket.future is not None and not ticket.future.done():  # done: its request went away
            if ticket.error is not None:
                ticket.future.set_exception(ticket.error)
            else:
                ticket.future.set_result(ticket.info)
