"""The cluster's rules: jobs, nodes, launches, logs, metrics; carried out against the store.

``ClusterService`` is what the HTTP routers call. Every public method is a short transaction
under one lock (SQLite allows one writer; one server process owns the state) and never
blocks on the network. Long-polls are done by the routers with ``notifier`` keys:

    "node:<id>"   the node's desired launches changed      (heartbeat long-poll)
    "logs:<seq>"  new log lines of a job                    (logs -f)
    "metrics:<seq>", "job:<seq>", "jobs"                    (metrics / status follow)

``tick()`` is the control loop's one step (tests call it directly): nodes that missed their
heartbeats become LOST, then one scheduling cycle places queued jobs. ``start()`` runs it in a
background thread whenever something changes, and at least every ``tick_s``.

Job life (see ``torchrelay.spec.TRANSITIONS``): submit -> QUEUED; placed -> SCHEDULED with one
launch (one torchrun) per node; first launch running -> RUNNING; every launch of the attempt
succeeded -> SUCCEEDED. A launch that fails makes the server stop the attempt's other launches
at once (their agents hear it on the long-poll), then the job restarts (RESTARTING, a new
attempt placed like a queued job) while restarts are left, else FAILED naming the rank.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.orm import Session

from torchrelay import scheduler as policy
from torchrelay.errors import InvalidSpec, NotFound, StorageError, Unschedulable
from torchrelay.server.notify import Notifier
from torchrelay.server.quotas import QuotaTable
from torchrelay.server.store import (CursorRow, EventRow, JobRow, LaunchRow, LogRow, MetricRow, NodeRow,
                                     job_id_of, job_seq_of, make_engine, make_sessionmaker)
from torchrelay.spec import JobSpec, JobState, ParameterServerStrategy, Resources, check_transition
from torchrelay.storage import ArtifactStore
from torchrelay.wire import (ArtifactInfo, FailureInfo, Heartbeat, HeartbeatReply, JobEvent, JobInfo,
                             LaunchAssignment, LaunchStatus, LogBatch, LogLine, LogPage, MetricBatch,
                             MetricPage, MetricPoint, NodeInfo, NodeRegistration, PlacementInfo,
                             RankExit, RegisterReply)

_log = logging.getLogger("torchrelay.server")
# a launch's states in the order they happen: a status never moves a launch back (resends)
_LAUNCH_ORDER = {"pending": 0, "preparing": 1, "running": 2, "exited": 3}
# the launch columns a heartbeat reply is built from (read as plain rows, no ORM objects)
_ASSIGNMENT_COLUMNS = tuple(LaunchRow.__table__.c[name] for name in (
    "id", "job_seq", "attempt", "node_id", "node_rank", "nnodes", "nproc", "rank_offset", "world_size", "gpu",
    "desired", "stop_reason", "state", "master_port", "stop_grace_s"))
# the stop reason of launches stopped at the job's max_runtime_s; an attempt stopped so ends FAILED
_RUNTIME_STOP = "ran past max_runtime_s"


def process_count(spec: JobSpec) -> int:
    """Processes the job runs: its workers, plus parameter servers placed like workers."""
    extra = spec.strategy.servers if isinstance(spec.strategy, ParameterServerStrategy) else 0
    return spec.workers + extra


def _shape(res: Resources) -> policy.WorkerShape:
    return policy.WorkerShape(cpu=res.cpu, gpu=res.gpu, memory=res.memory, gpu_type=res.gpu_type,
                              accelerator=res.accelerator_mode)


def worker_shape(spec: JobSpec) -> policy.WorkerShape:
    return _shape(spec.resources)


def job_roles(spec: JobSpec) -> tuple[tuple[str, int, policy.WorkerShape], ...]:
    """The job's processes besides its workers, as the policy places them: a parameter-server
    job's servers with their own resources (ranks ``workers .. workers + servers - 1``)."""
    if isinstance(spec.strategy, ParameterServerStrategy):
        return (("server", spec.strategy.servers, _shape(spec.strategy.server_resources)),)
    return ()


def queued_job(row: JobRow, spec: JobSpec) -> policy.QueuedJob:
    return policy.QueuedJob(
        job_id=row.id, user=row.user or "", priority=row.priority, submit_seq=row.seq,
        workers=spec.workers, shape=worker_shape(spec),
        workers_per_node=spec.workers_per_node if spec.nodes else None, nodes=spec.nodes,
        labels=tuple(sorted(spec.labels.items())), preemptible=spec.preemptible,
        max_runtime_s=spec.max_runtime_s, roles=job_roles(spec))


def _granted(launch: Any, gpu_type: str | None) -> policy.WorkerShape:
    """The shape the policy granted, as a launch records it."""
    return policy.WorkerShape(cpu=launch.cpu, gpu=launch.gpu, memory=launch.memory,
                              gpu_type=gpu_type if launch.gpu else None,
                              accelerator="required" if launch.gpu else "none")


_SCHEDULER_STATES = (JobState.QUEUED.value, JobState.SCHEDULED.value, JobState.RUNNING.value,
                     JobState.RESTARTING.value, JobState.CANCELLING.value)
_BRIEF_COLUMNS = (JobRow.seq, JobRow.name, JobRow.user, JobRow.state, JobRow.priority, JobRow.submitted_at,
                  JobRow.started_at, JobRow.attempt, JobRow.requeue, JobRow.waiting_reason)


@dataclass(frozen=True, slots=True)
class _Brief:
    """The columns of a job row one scheduling cycle needs (read without building ORM objects)."""

    seq: int
    name: str
    user: str | None
    state: str
    priority: int
    submitted_at: float
    started_at: float | None
    attempt: int
    requeue: bool | None
    waiting_reason: str | None

    @property
    def id(self) -> str:
        return job_id_of(self.seq)


@dataclass(slots=True)
class _PendingSubmit:
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


def _resolve_futures(tickets: list[_PendingSubmit]) -> None:
    """On the tickets' event loop: hand each waiting ``submit_async`` its JobInfo or error."""
    for ticket in tickets:
        if ticket.future is not None and not ticket.future.done():  # done: its request went away
            if ticket.error is not None:
                ticket.future.set_exception(ticket.error)
            else:
                ticket.future.set_result(ticket.info)


class ClusterService:
    """Owns the store; see the module docstring for the contract."""

    def __init__(self, db_url: str, store_url: str, *, heartbeat_timeout_s: float = 10.0,
                 tick_s: float = 0.5, clock: Callable[[], float] = time.time, quotas: QuotaTable | None = None):
        self.engine = make_engine(db_url)
        self._sessions = make_sessionmaker(self.engine)
        self.store = ArtifactStore(store_url)
        self.notifier = Notifier()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.tick_s = tick_s
        self.clock = clock
        self.public_url = ""  # set by the app once the server's address is known
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._spec_cache: dict[int, JobSpec] = {}
        self._queued_cache: dict[int, policy.QueuedJob] = {}  # job seq -> the policy's view while it waits
        self._env_cache: dict[int, dict[str, str]] = {}  # job seq -> its launches' spec-derived environment
        self._argv_cache: dict[int, list[str]] = {}  # job seq -> its entrypoint split into argv
        self.quotas = quotas or QuotaTable()
        # job seq -> (attempt, server time it was placed): what max_runtime_s counts from
        self._attempt_started: dict[int, tuple[int, float]] = {}
        self._ready_nodes: tuple[policy.NodeView, ...] | None = None  # None: read again
        self._pending: list[_PendingSubmit] = []  # submissions waiting for the group commit
        self._pending_lock = threading.Lock()
        self._flush_queued = False  # a write of ``_pending`` is queued on ``_writer`` (under _pending_lock)
        self._writer: ThreadPoolExecutor | None = None  # one thread: writes for ``submit_async``
        self.min_tick_interval_s = 0.02  # a burst of submits shares one scheduling cycle
        self._check_interval_s = min(0.25, tick_s / 2)  # lost nodes, hangs, runtimes: see ``tick``
        self._last_checks = float("-inf")

    # ------------------------------------------------------------ background loop

    def start(self) -> None:
        """Run ``tick`` in a daemon thread until ``stop``. Idempotent.

        Every READY node gets a fresh heartbeat timeout first: after a server restart its
        agent needs that long to find the server again before the node counts as LOST."""
        if self._thread is None:
            with self._lock, self._sessions.begin() as s:
                for node in s.scalars(select(NodeRow).where(NodeRow.state == "READY")):
                    node.last_seen = max(node.last_seen, self.clock())
            self._thread = threading.Thread(target=self._loop, name="relay-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._pending_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)  # submissions already accepted for writing are written
        self.engine.dispose()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:  # the loop must survive a bad row; the error is logged
                logging.getLogger("torchrelay.server").exception("scheduler tick failed")
            # a long queue makes a cycle cost more: space cycles so that they hold the lock at
            # most about a third of the time and requests (submits, heartbeats) get through
            self._stop.wait(max(self.min_tick_interval_s, 2 * (time.monotonic() - started)))
            self._wake.wait(self.tick_s)
            self._wake.clear()

    def _kick(self) -> None:
        self._wake.set()

    def tick(self) -> None:
        """One control-loop step: mark lost nodes, then schedule. Idempotent."""
        with self._lock, self._sessions.begin() as s:
            now = self.clock()
            # The three checks only find something once the clock has moved past a deadline
            # (last heartbeat, last metric, placement time), so while jobs come and go quickly
            # and cycles run every few tens of ms they are run at most every ``_check_interval_s``.
            if not 0 <= now - self._last_checks < self._check_interval_s:  # (a clock set back: run)
                self._last_checks = now
                self._mark_lost_nodes(s)
                self._check_progress(s)
                self._check_runtime(s)
            self._schedule(s)

    # ------------------------------------------------------------ jobs

    def submit(self, spec_data: dict[str, Any], bundle: str | None, user: str | None) -> JobInfo:
        """Validate and queue a job; returns once it is committed to the store. Blocks (the
        write); any thread. Raises InvalidSpec, NotFound (bundle), Unschedulable."""
        ticket = self._validated(spec_data, bundle, user)
        self._check_bundle(bundle)
        with self._pending_lock:
            self._pending.append(ticket)
        with self._lock:  # group commit: the first to get the lock writes every pending submission
            if not ticket.done:
                self._write_pending_submits()
        if ticket.error is not None:
            raise ticket.error
        assert ticket.info is not None
        return ticket.info

    async def submit_async(self, spec_data: dict[str, Any], bundle: str | None, user: str | None) -> JobInfo:
        """``submit`` for an event loop: the same contract, and the loop is never blocked.

        Validation runs inline (tens of microseconds); the write runs on the service's one
        writer thread, which commits every submission pending at that moment in one
        transaction, so concurrent requests share a commit (group commit) without a thread
        each. Returns once this job is committed."""
        ticket = self._validated(spec_data, bundle, user)
        if bundle is not None:
            await asyncio.to_thread(self._check_bundle, bundle)  # the store may be remote
        ticket.loop = asyncio.get_running_loop()
        ticket.future = ticket.loop.create_future()
        with self._pending_lock:
            self._pending.append(ticket)
            if not self._flush_queued:
                if self._writer is None:
                    self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-submit-writer")
                self._writer.submit(self._flush_pending_submits)
                self._flush_queued = True
        return await ticket.future

    def _validated(self, spec_data: dict[str, Any], bundle: str | None, user: str | None) -> "_PendingSubmit":
        """The submission as a ticket ready to write. No I/O. Raises InvalidSpec."""
        spec = JobSpec.parse(spec_data)
        if spec.user is None and user:
            spec = spec.model_copy(update={"user": user})
        probe = queued_job(JobRow(seq=0, priority=spec.priority, user=spec.user), spec)
        problem = policy.job_problem(probe)
        if problem:
            raise InvalidSpec(f"job {spec.name!r}: {problem}")
        return _PendingSubmit(spec=spec, public=spec.to_public(), bundle=bundle, probe=probe)

    def _check_bundle(self, bundle: str | None) -> None:
        if bundle is not None and not self.store.exists(ArtifactStore.bundle_key(bundle)):
            raise NotFound(f"bundle {bundle} was not uploaded; POST it to /api/v1/bundles first")

    def _flush_pending_submits(self) -> None:
        """The writer thread's task: write whatever is pending (it may be nothing: a ``submit``
        caller may have written it already)."""
        with self._lock:
            self._write_pending_submits()

    def _write_pending_submits(self) -> None:
        """Insert every queued submission in one transaction (caller holds ``_lock``). Concurrent
        submits wait on the lock anyway; writing them together costs one commit and one
        executemany instead of one each. Each ticket gets its JobInfo or its error; waiting
        ``submit_async`` callers are resolved on their loops; one scheduling pass is asked for."""
        with self._pending_lock:
            tickets, self._pending = self._pending, []
            self._flush_queued = False
        if not tickets:
            return
        try:
            with self._sessions.begin() as s:
                nodes = self._ready_node_views(s)
                good = []
                for ticket in tickets:
                    if nodes and not policy.fits_ever(ticket.probe, nodes):
                        ticket.error = Unschedulable(self._never_fits_message(ticket.spec, list(nodes)))
                    else:
                        good.append(ticket)
                written = self._insert_jobs(s, good) if good else []
            # only once committed: a rolled-back insert's seq may be handed out again
            for ticket, seq in written:
                self._spec_cache[seq] = ticket.spec
                self._queued_cache[seq] = dataclasses.replace(ticket.probe, job_id=job_id_of(seq), submit_seq=seq)
        except BaseException as exc:  # nothing was written: every ticket without its own error gets this one
            for ticket in tickets:
                if ticket.error is None:
                    ticket.info, ticket.error = None, exc
            raise
        finally:
            waiting: dict[asyncio.AbstractEventLoop, list[_PendingSubmit]] = {}
            for ticket in tickets:
                ticket.done = True
                if ticket.loop is not None:
                    waiting.setdefault(ticket.loop, []).append(ticket)
            for loop, group in waiting.items():  # one wake-up per loop, not one per request
                try:
                    loop.call_soon_threadsafe(_resolve_futures, group)
                except RuntimeError:  # loop closed at shutdown: nobody waits any more
                    pass
            if any(t.error is None for t in tickets):
                self.notifier.bump("jobs")
                self._kick()

    def _insert_jobs(self, s: Session, tickets: list["_PendingSubmit"]) -> list[tuple["_PendingSubmit", int]]:
        """Insert the jobs and their first events; set each ticket's ``info``. Returns (ticket, seq)."""
        # Core inserts and JobInfos built from what was written: the ORM's unit of work and a
        # read-back cost more than the inserts themselves (see bench/scheduler.py part b)
        now = self.clock()
        conn = s.connection()
        rows = [dict(name=t.spec.name, user=t.spec.user, state=JobState.QUEUED.value, spec=t.public, bundle=t.bundle,
                     priority=t.spec.priority, submitted_at=now, attempt=0, restarts=0, restart_reasons=[],
                     last_metrics={}, requeue=False) for t in tickets]
        table = JobRow.__table__
        if conn.dialect.name == "sqlite":
            # One multi-row INSERT ... RETURNING. SQLite gives each new row one more than the
            # table's largest rowid as it inserts the VALUES rows in order, so ascending seqs
            # are the rows in parameter order; only the order RETURNING lists them in is not
            # defined. (SQLAlchemy's sort_by_parameter_order cannot prove that for SQLite and
            # falls back to one INSERT per row.)
            seqs = sorted(r[0] for r in conn.execute(insert(table).returning(table.c.seq), rows))
        else:
            seqs = [r[0] for r in conn.execute(insert(table).returning(table.c.seq, sort_by_parameter_order=True),
                                               rows)]
        conn.execute(insert(EventRow.__table__), [dict(job_seq=seq, time=now, state=JobState.QUEUED.value,
                                                       message="submitted") for seq in seqs])
        for ticket, seq in zip(tickets, seqs):
            ticket.info = JobInfo(id=job_id_of(seq), name=ticket.spec.name, user=ticket.spec.user,
                                  state=JobState.QUEUED, spec=ticket.public, bundle=ticket.bundle,
                                  priority=ticket.spec.priority, submitted_at=now, attempt=0, restarts=0,
                                  events=[JobEvent(time=now, state=JobState.QUEUED, message="submitted")])
        return list(zip(tickets, seqs))

    def list_jobs(self, state: str | None = None, limit: int = 100) -> list[JobInfo]:
        with self._sessions() as s:
            q = select(JobRow).order_by(JobRow.seq.desc()).limit(max(1, min(limit, 10000)))
            if state:
                states = [x.strip().upper() for x in state.split(",") if x.strip()]
                bad = [x for x in states if x not in JobState.__members__]
                if bad:
                    raise InvalidSpec(f"state {bad[0]!r} is not a job state; use one of "
                                      f"{', '.join(JobState.__members__)}")
                q = q.where(JobRow.state.in_(states))
            rows = list(s.scalars(q))
            # node names and placements for the whole page in two queries, not two per job
            names = {n.id: n.name for n in s.scalars(select(NodeRow))}
            placed: dict[tuple[int, int], list[LaunchRow]] = {}
            placed_seqs = [row.seq for row in rows if row.attempt]
            for chunk in range(0, len(placed_seqs), 500):
                for x in s.scalars(select(LaunchRow).where(LaunchRow.job_seq.in_(placed_seqs[chunk:chunk + 500]))
                                   .order_by(LaunchRow.node_rank)):
                    placed.setdefault((x.job_seq, x.attempt), []).append(x)
            return [self._job_info(s, row, names=names, launches=placed.get((row.seq, row.attempt), []))
                    for row in rows]

    def get_job(self, job_id: str) -> JobInfo:
        with self._sessions() as s:
            return self._job_info(s, self._job(s, job_id), events=True)

    def job_state(self, job_id: str) -> tuple[int, JobState]:
        with self._sessions() as s:
            row = self._job(s, job_id)
            return row.seq, JobState(row.state)

    def cancel(self, job_id: str, checkpoint: bool = True) -> JobInfo:
        """Cancel a job; idempotent (a finished job is returned unchanged).

        Workers get SIGTERM, then SIGKILL after the job's ``stop_grace_s``, in which a
        cooperating script commits a checkpoint (``checkpoint=True``); ``checkpoint=False``
        kills them at once."""
        with self._lock, self._sessions.begin() as s:
            row = self._job(s, job_id)
            state = JobState(row.state)
            if state == JobState.QUEUED or (state == JobState.RESTARTING and not self._live_launches(s, row)):
                self._set_state(s, row, JobState.CANCELLED if state == JobState.QUEUED else JobState.CANCELLING,
                                "cancelled by user")
                if JobState(row.state) == JobState.CANCELLING:
                    self._set_state(s, row, JobState.CANCELLED, "no process was running")
            elif state.active and state != JobState.CANCELLING:
                self._set_state(s, row, JobState.CANCELLING, "cancel requested"
                                + ("" if checkpoint else " (no checkpoint: workers killed at once)"))
                if not checkpoint:
                    for launch in self._live_launches(s, row):
                        launch.stop_grace_s = 0.0
                self._stop_launches(s, row, "job cancelled")
                self._evaluate(s, row)
            info = self._job_info(s, row, events=True)
        return info

    def logs(self, job_id: str, after: int = 0, rank: int | None = None, limit: int = 5000) -> LogPage:
        with self._sessions() as s:
            row = self._job(s, job_id)
            q = select(LogRow).where(LogRow.job_seq == row.seq, LogRow.id > after)
            if rank is not None:
                q = q.where(LogRow.rank == rank)
            lines = list(s.scalars(q.order_by(LogRow.id).limit(limit)))
            out = [LogLine(seq=x.id, rank=x.rank, attempt=x.attempt, stream=x.stream, text=x.text) for x in lines]
            return LogPage(lines=out, next_after=lines[-1].id if lines else after, job_state=JobState(row.state))

    def metrics(self, job_id: str, after: int = 0, limit: int = 10000) -> MetricPage:
        with self._sessions() as s:
            row = self._job(s, job_id)
            q = (select(MetricRow).where(MetricRow.job_seq == row.seq, MetricRow.id > after)
                 .order_by(MetricRow.id).limit(limit))
            pts = list(s.scalars(q))
            out = [MetricPoint(seq=p.id, rank=p.rank, step=p.step, time=p.time, values=p.values) for p in pts]
            return MetricPage(points=out, next_after=pts[-1].id if pts else after, job_state=JobState(row.state))

    def artifacts(self, job_id: str) -> list[ArtifactInfo]:
        with self._sessions() as s:
            row = self._job(s, job_id)
        prefix = f"{ArtifactStore.job_prefix(row.id)}/artifacts"
        return [ArtifactInfo(path=p, size=n) for p, n in self.store.list(prefix)]

    def artifact_key(self, job_id: str, path: str) -> str:
        with self._sessions() as s:
            row = self._job(s, job_id)
        return ArtifactStore.artifact_key(row.id, path)

    # ------------------------------------------------------------ nodes

    def register(self, reg: NodeRegistration) -> RegisterReply:
        """Add a node, or bring a known one (same node_id) back to READY. Idempotent."""
        now = self.clock()
        with self._lock, self._sessions.begin() as s:
            node = s.get(NodeRow, reg.node_id) if reg.node_id else None
            if node is None:
                node = NodeRow(id=reg.node_id or f"node-{uuid.uuid4().hex[:8]}", name=reg.name,
                               address=reg.address, cpus=reg.cpus, gpus=reg.gpus, gpu_type=reg.gpu_type,
                               memory=reg.memory, labels=reg.labels, state="READY", last_seen=now)
                s.add(node)
            else:
                node.name, node.address, node.cpus, node.gpus = reg.name, reg.address, reg.cpus, reg.gpus
                node.gpu_type, node.memory, node.labels = reg.gpu_type, reg.memory, reg.labels
                node.state, node.last_seen = "READY", now
            node_id = node.id
            self._ready_nodes = None
        self._kick()
        self.notifier.bump(f"node:{node_id}")
        return RegisterReply(node_id=node_id, heartbeat_timeout_s=self.heartbeat_timeout_s)

    def heartbeat(self, node_id: str, hb: Heartbeat) -> HeartbeatReply:
        """Record the node alive, apply the status changes it carries (``hb.statuses``, as
        ``launch_status`` would, in order, in this one transaction) and what it runs; return its
        desired launches (no waiting). Statuses of launches unknown or not on this node are
        skipped (logged), so one stale entry cannot make every later heartbeat fail."""
        now = self.clock()
        nodes = NodeRow.__table__
        with self._lock, self._sessions.begin() as s:
            conn = s.connection()
            node = conn.execute(select(nodes.c.state, nodes.c.address, nodes.c.gpu_type)
                                .where(nodes.c.id == node_id)).first()
            if node is None:
                raise NotFound(f"node {node_id} is not registered; register it again")
            was_lost = node.state == "LOST"
            conn.execute(update(nodes).where(nodes.c.id == node_id)
                         .values(last_seen=now, **({"state": "READY"} if was_lost else {})))
            if was_lost:
                self._ready_nodes = None
            # their launches and jobs in one query; held, since the session's identity map keeps
            # only objects referenced elsewhere, so that the gets below find them loaded
            loaded = self._launches_with_jobs(s, {r.launch_id for r in hb.statuses}) if hb.statuses else []
            for report in hb.statuses:
                launch = s.get(LaunchRow, report.launch_id)
                if launch is None or launch.node_id != node_id:
                    _log.warning("heartbeat of node %s: status of launch %s skipped (%s)", node_id,
                                 report.launch_id, "unknown" if launch is None else f"on node {launch.node_id}")
                    continue
                self._apply_status(s, launch, report.status)
            if hb.statuses:
                s.flush()  # the Core reads below do not autoflush
            reported = {r.launch_id for r in hb.launches}
            live = self._live_on_node(conn, node_id)
            # a launch the agent had acknowledged but no longer has was lost with the agent
            lost = [x.id for x in live if x.state in ("preparing", "running") and x.id not in reported]
            for launch_id in lost:
                self._launch_exited(s, s.get(LaunchRow, launch_id), LaunchStatus(
                    state="exited", succeeded=False, message="the agent no longer runs this launch"))
            if lost:
                s.flush()
                live = self._live_on_node(conn, node_id)
            # in the same transaction: the version is read under the lock before the launches are
            # built, so a change made after this reply bumps past it and wakes the next long-poll
            version = self.notifier.version(f"node:{node_id}")
            reply = HeartbeatReply(version=version, node_state="READY" if was_lost else node.state,
                                   launches=self._assignments(conn, node_id, node, live),
                                   statuses_taken=len(hb.statuses))
        if was_lost:
            self._kick()
        return reply

    def touch(self, node_id: str) -> None:
        """Record the node as seen now (the end of a long-poll heartbeat)."""
        now = self.clock()
        nodes = NodeRow.__table__
        with self._lock, self.engine.begin() as conn:
            # a write per long-poll is not needed: LOST is decided at heartbeat_timeout_s scale
            conn.execute(update(nodes).where(nodes.c.id == node_id, nodes.c.state == "READY",
                                             nodes.c.last_seen < now - self.heartbeat_timeout_s / 20)
                         .values(last_seen=now))

    def desired(self, node_id: str) -> HeartbeatReply:
        """The node's launches as its agent should run them, with the version they are as of."""
        version = self.notifier.version(f"node:{node_id}")
        nodes = NodeRow.__table__
        with self.engine.connect() as conn:
            node = conn.execute(select(nodes.c.state, nodes.c.address, nodes.c.gpu_type)
                                .where(nodes.c.id == node_id)).first()
            if node is None:
                raise NotFound(f"node {node_id} is not registered; register it again")
            return HeartbeatReply(version=version, node_state=node.state,  # type: ignore[arg-type]
                                  launches=self._assignments(conn, node_id, node, self._live_on_node(conn, node_id)))

    @staticmethod
    def _live_on_node(conn: Any, node_id: str) -> list[Any]:
        """The node's launches that have not exited, with their job's bundle: plain rows, one query."""
        launches, jobs = LaunchRow.__table__, JobRow.__table__
        return conn.execute(select(*_ASSIGNMENT_COLUMNS, jobs.c.bundle)
                            .join(jobs, jobs.c.seq == launches.c.job_seq)
                            .where(launches.c.node_id == node_id, launches.c.state != "exited")
                            .order_by(launches.c.job_seq, launches.c.id)).all()

    def list_nodes(self) -> list[NodeInfo]:
        with self._sessions() as s:
            out = []
            for node in s.scalars(select(NodeRow).order_by(NodeRow.name, NodeRow.id)):
                live = s.scalars(select(LaunchRow).where(LaunchRow.node_id == node.id,
                                                         LaunchRow.state != "exited")).all()
                out.append(NodeInfo(
                    id=node.id, name=node.name, address=node.address, state=node.state,  # type: ignore[arg-type]
                    cpus=node.cpus, gpus=node.gpus, gpu_type=node.gpu_type, memory=node.memory,
                    labels=node.labels or {}, last_seen=node.last_seen,
                    used_cpus=sum(x.cpu * x.nproc for x in live), used_gpus=sum(x.gpu * x.nproc for x in live),
                    used_memory=sum(x.memory * x.nproc for x in live), launches=[x.id for x in live]))
            return out

    def launch_status(self, launch_id: str, status: LaunchStatus) -> None:
        """Record an agent's report on a launch. Idempotent; reports on an exited launch are
        ignored, and so is one that would move the launch back (a resent ``preparing``)."""
        with self._lock, self._sessions.begin() as s:
            loaded = self._launches_with_jobs(s, {launch_id})  # (held: see ``heartbeat``)
            if not loaded:
                raise NotFound(f"launch {launch_id} is unknown")
            self._apply_status(s, loaded[0][0], status)

    @staticmethod
    def _launches_with_jobs(s: Session, launch_ids: set[str]) -> list[Any]:
        """(LaunchRow, JobRow) of each known launch in ``launch_ids``: one query."""
        return list(s.execute(select(LaunchRow, JobRow).join(JobRow, JobRow.seq == LaunchRow.job_seq)
                              .where(LaunchRow.id.in_(launch_ids))))

    def _apply_status(self, s: Session, launch: LaunchRow, status: LaunchStatus) -> None:
        """``launch_status``'s rules for one report (caller holds ``_lock`` and the transaction)."""
        if launch.state == "exited":
            return
        if status.master_port and launch.master_port != status.master_port:
            launch.master_port = status.master_port
            if launch.nnodes > 1:  # the peers wait for it; a launch alone in its attempt has none
                for peer in self._attempt_launches(s, launch.job_seq, launch.attempt):
                    self.notifier.bump(f"node:{peer.node_id}")
        if status.state == "exited":
            self._launch_exited(s, launch, status)
        elif _LAUNCH_ORDER[status.state] > _LAUNCH_ORDER.get(launch.state, 0):
            launch.state = status.state
            self._evaluate(s, s.get(JobRow, launch.job_seq), self._alone(launch))

    def ingest_logs(self, job_id: str, batch: LogBatch) -> int:
        """Store new log records; resent ones (seq already seen) are skipped. Returns rows added."""
        with self._lock, self._sessions.begin() as s:
            row = self._job(s, job_id)
            fresh = self._unseen(s, batch.records, lambda r: f"{batch.launch_id}/{r.rank}/{r.stream}")
            if fresh:  # one bulk INSERT: ingest runs on the same cores as the workers
                s.execute(insert(LogRow), [
                    {"job_seq": row.seq, "launch_id": batch.launch_id, "attempt": r.attempt, "rank": r.rank,
                     "stream": r.stream, "agent_seq": r.seq, "text": r.text} for r in fresh])
            seq = row.seq
        if fresh:
            self.notifier.bump(f"logs:{seq}")
        return len(fresh)

    def ingest_metrics(self, job_id: str, batch: MetricBatch) -> int:
        """Store new metric points (resends skipped); updates the job's last metrics and its
        progress clock (hang detection). Returns points added."""
        with self._lock, self._sessions.begin() as s:
            row = self._job(s, job_id)
            fresh = self._unseen(s, batch.records, lambda r: f"{batch.launch_id}/{r.rank}/metrics")
            if fresh:
                s.execute(insert(MetricRow), [
                    {"job_seq": row.seq, "launch_id": batch.launch_id, "rank": r.rank, "agent_seq": r.seq,
                     "step": r.step, "time": r.time, "values": r.values} for r in fresh])
                if any(self._live_launches(s, row)):
                    row.last_progress_at = self.clock()
                latest = min(fresh, key=lambda r: (r.rank, -r.step))  # the lowest rank's newest step
                row.last_metrics = {**(row.last_metrics or {}), **latest.values, "step": latest.step,
                                    "time": latest.time}
            seq = row.seq
        if fresh:
            self.notifier.bump(f"metrics:{seq}")
            self.notifier.bump(f"job:{seq}")
        return len(fresh)

    @staticmethod
    def _unseen(s: Session, records: list, key_of: Callable) -> list:
        """The records newer than what was stored before for their key (launch, rank, stream),
        in sequence order; advances each key's cursor. Makes an agent's resend harmless."""
        out = []
        for key, group in _group(records, key_of):
            cursor = s.get(CursorRow, key) or CursorRow(key=key, last_seq=-1)
            fresh = [r for r in sorted(group, key=lambda r: r.seq) if r.seq > cursor.last_seq]
            if fresh:
                cursor.last_seq = fresh[-1].seq
                s.merge(cursor)
                out += fresh
        return out

    # ------------------------------------------------------------ internals: lookups

    def _spec(self, row: JobRow) -> JobSpec:
        """The job's parsed spec; specs never change after submit, so parsing once is enough."""
        spec = self._spec_cache.get(row.seq)
        if spec is None:
            spec = self._spec_cache[row.seq] = JobSpec.parse(row.spec)
        return spec

    def _spec_of(self, s: Session, seq: int) -> JobSpec:
        """``_spec`` by job seq: reads the spec column only when this process has not parsed it."""
        spec = self._spec_cache.get(seq)
        if spec is None:
            data = s.scalar(select(JobRow.spec).where(JobRow.seq == seq))
            spec = self._spec_cache[seq] = JobSpec.parse(data)
        return spec

    def _job(self, s: Session, job_id: str) -> JobRow:
        seq = job_seq_of(job_id)
        row = s.get(JobRow, seq) if seq is not None else None
        if row is None:
            raise NotFound(f"job {job_id!r} does not exist; `relay ls` lists the jobs")
        return row

    def _ready_node_views(self, s: Session) -> tuple[policy.NodeView, ...]:
        """``_node_views(s)`` cached until a node registers or changes state (submit's check)."""
        if self._ready_nodes is None:
            self._ready_nodes = tuple(self._node_views(s))
        return self._ready_nodes

    def _node_views(self, s: Session, include_lost: bool = False) -> list[policy.NodeView]:
        """Nodes as the policy sees them; LOST ones (only with ``include_lost``) are not ready,
        so a job that fits them waits for them instead of being called unschedulable."""
        q = select(NodeRow).order_by(NodeRow.id)
        if not include_lost:
            q = q.where(NodeRow.state == "READY")
        return [policy.NodeView(id=n.id, cpus=n.cpus, gpus=n.gpus, memory=n.memory, gpu_type=n.gpu_type,
                                labels=tuple(sorted((n.labels or {}).items())), ready=n.state == "READY")
                for n in s.scalars(q)]

    def _never_fits_message(self, spec: JobSpec, nodes: list[policy.NodeView]) -> str:
        res = spec.resources
        servers = "".join(f" and {count} {name}s × (cpu={shape.cpu:g}, gpu={shape.gpu}, memory={shape.memory})"
                          for name, count, shape in job_roles(spec))
        return (f"job {spec.name!r} can never run here: it needs {spec.workers} workers × "
                f"(cpu={res.cpu:g}, gpu={res.gpu}, memory={res.memory}){servers} but the cluster's "
                f"{len(nodes)} ready node(s) hold cpus={sum(n.cpus for n in nodes):g}, "
                f"gpus={sum(n.gpus for n in nodes)}, memory={sum(n.memory for n in nodes)} in all; "
                f"lower `workers` or the per-worker `resources`, or add nodes")

    def _attempt_launches(self, s: Session, job_seq: int, attempt: int) -> list[LaunchRow]:
        return list(s.scalars(select(LaunchRow).where(LaunchRow.job_seq == job_seq, LaunchRow.attempt == attempt)
                              .order_by(LaunchRow.node_rank)))

    def _live_launches(self, s: Session, row: JobRow) -> list[LaunchRow]:
        return [x for x in self._attempt_launches(s, row.seq, row.attempt) if x.state != "exited"]

    # ------------------------------------------------------------ internals: state changes

    def _set_state(self, s: Session, row: JobRow, target: JobState, message: str = "") -> None:
        current = JobState(row.state)
        if current == target:
            return
        check_transition(row.id, current, target)
        now = self.clock()
        row.state = target.value
        if target == JobState.RUNNING and row.started_at is None:
            row.started_at = now
        if target.terminal:
            row.finished_at = now
            row.waiting_reason = None
            # a finished job is never scheduled again: its cached spec and attempt clock go
            self._spec_cache.pop(row.seq, None)
            self._queued_cache.pop(row.seq, None)
            self._env_cache.pop(row.seq, None)
            self._argv_cache.pop(row.seq, None)
            self._attempt_started.pop(row.seq, None)
        s.add(EventRow(job_seq=row.seq, time=now, state=target.value, message=message))
        self.notifier.bump(f"job:{row.seq}")
        self.notifier.bump(f"logs:{row.seq}")
        self.notifier.bump(f"metrics:{row.seq}")
        self.notifier.bump("jobs")
        if target.terminal or target in (JobState.QUEUED, JobState.RESTARTING):
            self._kick()

    def _stop_launches(self, s: Session, row: JobRow, reason: str) -> None:
        for launch in self._live_launches(s, row):
            if launch.desired != "stop":
                launch.desired, launch.stop_reason = "stop", reason
                self.notifier.bump(f"node:{launch.node_id}")

    def _launch_exited(self, s: Session, launch: LaunchRow, status: LaunchStatus, infra: bool = False) -> None:
        launch.state = "exited"
        launch.ranks = [r.model_dump() for r in status.ranks]
        launch.succeeded = bool(status.succeeded)
        launch.stopped = status.stopped or (launch.desired == "stop" and not status.succeeded)
        launch.message = status.message
        launch.infra = infra
        self.notifier.bump(f"node:{launch.node_id}")
        self._kick()
        self._evaluate(s, s.get(JobRow, launch.job_seq), self._alone(launch))

    @staticmethod
    def _alone(launch: LaunchRow) -> list[LaunchRow] | None:
        """``[launch]`` when it is the only launch of its attempt (one node), else None (read them)."""
        return [launch] if launch.nnodes == 1 else None

    def _check_runtime(self, s: Session) -> None:
        """A job whose current attempt has held its nodes longer than its ``max_runtime_s`` is
        stopped; once its launches have exited it is FAILED (never restarted), see ``_evaluate``.
        The time counts from the attempt's placement: that is when its resources were taken,
        and what the policy's reservations assume."""
        now = self.clock()
        for seq, in s.execute(select(JobRow.seq).where(JobRow.state.in_(
                (JobState.SCHEDULED.value, JobState.RUNNING.value, JobState.RESTARTING.value)))):
            limit = self._spec_of(s, seq).max_runtime_s
            if not limit:  # most jobs declare none: no row is loaded for them
                continue
            row = s.get(JobRow, seq)
            if row.requeue:
                continue
            started = self._attempt_start(s, row)
            if started is None or now - started <= limit:
                continue
            live = self._live_launches(s, row)
            if not live or all(x.desired == "stop" for x in live):
                continue
            reason = f"{_RUNTIME_STOP}={limit:g} s (attempt {row.attempt} ran {now - started:.0f} s)"
            self._stop_launches(s, row, reason)
            s.add(EventRow(job_seq=row.seq, time=now, state=row.state, message=f"stopping: {reason}"))
            self.notifier.bump(f"job:{row.seq}")

    def _attempt_start(self, s: Session, row: "JobRow | _Brief") -> float | None:
        """When the job's current attempt was placed (server clock), or None before any."""
        if not row.attempt:
            return None
        known = self._attempt_started.get(row.seq)
        if known is not None and known[0] == row.attempt:
            return known[1]
        # not placed by this process (the server restarted): the placement event says when
        placed = s.scalar(select(func.max(EventRow.time)).where(EventRow.job_seq == row.seq,
                                                                 EventRow.message.like("%placed on%")))
        started = float(placed if placed is not None else (row.started_at or row.submitted_at))
        self._attempt_started[row.seq] = (row.attempt, started)
        return started

    def _evaluate(self, s: Session, row: JobRow, launches: list[LaunchRow] | None = None) -> None:
        """Move the job on from what its current attempt's launches report (``launches``: they,
        when the caller holds them all). Idempotent."""
        state = JobState(row.state)
        if state.terminal or state == JobState.QUEUED:
            return
        if launches is None or any(x.attempt != row.attempt for x in launches):  # (a replaced attempt's)
            launches = self._attempt_launches(s, row.seq, row.attempt)
        if not launches:
            return
        all_exited = all(x.state == "exited" for x in launches)
        if state in (JobState.SCHEDULED, JobState.RESTARTING) and any(x.state == "running" for x in launches):
            self._set_state(s, row, JobState.RUNNING, f"attempt {row.attempt} running")
            state = JobState.RUNNING
        if state == JobState.CANCELLING:
            if all_exited:
                self._set_state(s, row, JobState.CANCELLED, "all workers stopped")
            return
        if row.requeue:
            if all_exited:
                row.requeue = False
                self._set_state(s, row, JobState.QUEUED, "requeued after preemption")
            return
        overtime = next((x.stop_reason for x in launches if (x.stop_reason or "").startswith(_RUNTIME_STOP)), None)
        if overtime is not None:
            if all_exited:
                row.failure = FailureInfo(reason=overtime, attempt=row.attempt).model_dump()
                self._set_state(s, row, JobState.FAILED, overtime)
            return
        failed = [x for x in launches if x.state == "exited" and not x.succeeded]
        if failed:
            if row.hung_attempt == row.attempt and row.failure:
                failure = FailureInfo.model_validate(row.failure)
            else:
                failure = self._failure_of(s, row, failed)
            row.failure = failure.model_dump()
            self._stop_launches(s, row, f"attempt {row.attempt} failed: {failure.reason}")
            if not all_exited:
                return
            spec = self._spec(row)
            if all(x.infra for x in failed):
                row.restart_reasons = [*(row.restart_reasons or []), failure.model_dump()]
                self._set_state(s, row, JobState.RESTARTING,
                                f"{failure.reason}; restarting elsewhere (not counted against max_restarts)")
            elif row.restarts < spec.max_restarts:
                row.restarts += 1
                row.restart_reasons = [*(row.restart_reasons or []), failure.model_dump()]
                self._set_state(s, row, JobState.RESTARTING,
                                f"restart {row.restarts} of {spec.max_restarts}: {failure.reason}")
            else:
                self._set_state(s, row, JobState.FAILED, failure.reason)
            return
        if all_exited and all(x.succeeded for x in launches):
            row.failure = None
            if state == JobState.SCHEDULED:
                self._set_state(s, row, JobState.RUNNING, "started")
            self._set_state(s, row, JobState.SUCCEEDED, "every rank finished")

    def _failure_of(self, s: Session, row: JobRow, failed: list[LaunchRow]) -> FailureInfo:
        """The failing rank that explains the attempt: one that did not return and was not
        killed because a peer failed, else the first one that did not return."""
        # The agent lists a launch's failed ranks earliest death first, so a launch's first
        # failed rank is its root cause and the ones after it were torn down because of it.
        # A launch the server stopped (because a peer failed) only explains the attempt when
        # nothing else does.
        candidates: list[tuple[int, int, LaunchRow, RankExit]] = []
        for launch in failed:
            failed_ranks = [r for r in (RankExit.model_validate(d) for d in launch.ranks or []) if not r.returned]
            for position, rank in enumerate(failed_ranks):
                candidates.append((2 if launch.stopped else (1 if position else 0), launch.node_rank, launch, rank))
        node_names = {n.id: n.name for n in s.scalars(select(NodeRow))}
        if not candidates:
            launch = failed[0]
            return FailureInfo(reason=launch.message or f"launch on node {node_names.get(launch.node_id)} failed",
                               node=node_names.get(launch.node_id), attempt=row.attempt)
        candidates.sort(key=lambda c: (c[0], c[1]))
        _, _, launch, rank = candidates[0]
        if rank.exit_code is None and rank.signal is None:
            # the rank never ran (torchrun itself failed, e.g. its rendezvous): the launch says why
            return FailureInfo(reason=f"rank {rank.rank} did not run: {launch.message or 'no exit status'}",
                               rank=rank.rank, node=node_names.get(launch.node_id), last_lines=rank.last_lines,
                               attempt=row.attempt)
        if rank.signal:
            try:
                what = f"was killed by {signal.Signals(rank.signal).name}"
            except ValueError:
                what = f"was killed by signal {rank.signal}"
        else:
            what = f"exited with code {rank.exit_code}"
        return FailureInfo(reason=f"rank {rank.rank} {what}", rank=rank.rank, node=node_names.get(launch.node_id),
                           exit_code=rank.exit_code, signal=rank.signal, last_lines=rank.last_lines,
                           attempt=row.attempt)

    def _mark_lost_nodes(self, s: Session) -> None:
        deadline = self.clock() - self.heartbeat_timeout_s
        for node in s.scalars(select(NodeRow).where(NodeRow.state == "READY", NodeRow.last_seen < deadline)):
            node.state = "LOST"
            self._ready_nodes = None
            for launch in s.scalars(select(LaunchRow).where(LaunchRow.node_id == node.id,
                                                             LaunchRow.state != "exited")):
                self._launch_exited(s, launch, LaunchStatus(
                    state="exited", succeeded=False,
                    message=f"node {node.name} lost (no heartbeat for {self.heartbeat_timeout_s:g} s)"), infra=True)

    def _check_progress(self, s: Session) -> None:
        """A RUNNING job whose metrics stopped for ``hang_timeout_s`` is hung (e.g. a rank stopped
        inside a collective): its attempt is failed and stopped, and restarts as any failure does."""
        now = self.clock()
        for row in s.scalars(select(JobRow).where(JobRow.state == JobState.RUNNING.value,
                                                  JobRow.last_progress_at.is_not(None))):
            timeout = self._spec(row).hang_timeout_s
            if not timeout or now - row.last_progress_at <= timeout:
                continue
            row.last_progress_at = None
            self._stop_launches(s, row, f"no progress for {timeout:g} s (hung worker?)")
            s.add(EventRow(job_seq=row.seq, time=now, state=row.state,
                           message=f"no metric for {timeout:g} s: stopping attempt {row.attempt}"))
            row.failure = FailureInfo(reason=f"no progress for {timeout:g} s (hung worker?)",
                                      attempt=row.attempt).model_dump()
            row.hung_attempt = row.attempt

    # ------------------------------------------------------------ internals: scheduling

    def _policy_input(self, s: Session) -> tuple[policy.SchedulerInput, dict[str, tuple["_Brief", JobSpec]]]:
        """What the policy sees now: nodes, jobs holding resources, the queue and the quotas of
        the users in it. Read as plain columns (no ORM objects, no spec JSON: specs are parsed
        once per job and cached) and live launches in one query, so a cycle over a long queue
        costs little beyond the policy itself."""
        nodes = self._node_views(s, include_lost=True)
        live_by_job: dict[int, list[Any]] = {}
        for launch in s.execute(select(LaunchRow.job_seq, LaunchRow.attempt, LaunchRow.node_id, LaunchRow.nproc,
                                       LaunchRow.cpu, LaunchRow.gpu, LaunchRow.memory, LaunchRow.rank_offset)
                                .where(LaunchRow.state != "exited").order_by(LaunchRow.job_seq, LaunchRow.node_rank)):
            live_by_job.setdefault(launch.job_seq, []).append(launch)
        running, queue, rows = [], [], {}
        for row in s.execute(select(*_BRIEF_COLUMNS).where(JobRow.state.in_(_SCHEDULER_STATES)).order_by(JobRow.seq)):
            brief = _Brief(*row)
            spec = self._spec_of(s, brief.seq)
            live = [x for x in live_by_job.get(brief.seq, ()) if x.attempt == brief.attempt] if brief.attempt else []
            if live:
                # each launch records the shape the policy granted its processes; a
                # parameter-server job's server launches are those past its workers' ranks
                workers = [x for x in live if x.rank_offset < spec.workers]
                servers = [x for x in live if x.rank_offset >= spec.workers]
                roles = ()
                if servers:
                    server_gpu_type = (spec.strategy.server_resources.gpu_type
                                       if isinstance(spec.strategy, ParameterServerStrategy) else None)
                    roles = (("server", _granted(servers[0], server_gpu_type),
                              tuple((x.node_id, x.nproc) for x in servers)),)
                started = self._attempt_start(s, brief)
                running.append(policy.Allocation(
                    job_id=brief.id, user=brief.user or "", priority=brief.priority,
                    shape=_granted((workers or live)[0], spec.resources.gpu_type),
                    placement=tuple((x.node_id, x.nproc) for x in workers), preemptible=spec.preemptible,
                    started_at=started if started is not None else brief.submitted_at,
                    max_runtime_s=spec.max_runtime_s,
                    preempting=bool(brief.requeue) or brief.state == JobState.CANCELLING.value, roles=roles))
            elif brief.state in (JobState.QUEUED.value, JobState.RESTARTING.value):
                job = self._queued_cache.get(brief.seq)
                if job is None:  # what the policy is told of a waiting job never changes
                    job = self._queued_cache[brief.seq] = queued_job(brief, spec)  # type: ignore[arg-type]
                queue.append(job)
                rows[job.job_id] = (brief, spec)
        quotas = self.quotas.for_users([a.user for a in running] + [q.user for q in queue])
        inp = policy.SchedulerInput(nodes=tuple(nodes), running=tuple(running), queue=tuple(queue),
                                    now=self.clock(), quotas=quotas)
        return inp, rows

    def queue_view(self) -> list[dict[str, Any]]:
        """The waiting jobs in the order the policy considers them, each with why it waits and,
        where declared max runtimes allow, its estimated start. Changes nothing."""
        with self._lock, self._sessions() as s:
            inp, rows = self._policy_input(s)
            if not inp.queue:
                return []
            decisions = policy.schedule(inp)
        placed = {p.job_id for p in decisions.placements}
        order = list(decisions.order) or [q.job_id for q in inp.queue]
        out = []
        for position, job_id in enumerate(order, 1):
            row, spec = rows[job_id]
            out.append({"position": position, "id": job_id, "name": row.name, "user": row.user,
                        "priority": row.priority, "workers": process_count(spec), "state": row.state,
                        "submitted_at": row.submitted_at, "max_runtime_s": spec.max_runtime_s,
                        "reason": "starting" if job_id in placed else decisions.waiting.get(job_id, ""),
                        "estimated_start": decisions.estimated_start.get(job_id)})
        return out

    def _schedule(self, s: Session) -> None:
        inp, rows = self._policy_input(s)
        if not inp.queue:
            return
        # start estimates are for `relay queue` (queue_view) only: a tick does not pay for them
        decisions = policy.schedule(dataclasses.replace(inp, estimate_limit=0))
        by_id = {n.id: n for n in s.scalars(select(NodeRow))} if decisions.placements else {}
        placed_seqs = [rows[p.job_id][0].seq for p in decisions.placements]
        loaded: list[JobRow] = []  # held: the session's identity map only keeps objects referenced elsewhere
        for chunk in range(0, len(placed_seqs), 500):  # their rows in few queries: the gets below find them loaded
            loaded += s.scalars(select(JobRow).where(JobRow.seq.in_(placed_seqs[chunk:chunk + 500])))
        for placement in decisions.placements:
            brief, spec = rows[placement.job_id]
            self._place(s, s.get(JobRow, brief.seq), spec, placement, by_id)
        for victim in decisions.preemptions:
            vrow = self._job(s, victim)
            if JobState(vrow.state).active and JobState(vrow.state) != JobState.CANCELLING:
                vrow.requeue = True
                self._stop_launches(s, vrow, "preempted by a higher-priority job")
        changed = [{"b_seq": rows[job_id][0].seq, "b_reason": reason} for job_id, reason in decisions.waiting.items()
                   if job_id in rows and rows[job_id][0].waiting_reason != reason]
        if changed:  # one executemany, not one ORM object per waiting job
            s.connection().execute(
                update(JobRow.__table__).where(JobRow.__table__.c.seq == bindparam("b_seq"))
                .values(waiting_reason=bindparam("b_reason")), changed)

    def _place(self, s: Session, row: JobRow, spec: JobSpec, placement: policy.Placement,
               nodes: dict[str, NodeRow]) -> None:
        row.attempt += 1
        row.waiting_reason = None
        row.last_progress_at = None
        self._attempt_started[row.seq] = (row.attempt, self.clock())
        if row.attempt > 1:
            self._fence_checkpoints(row)
        # one launch (one torchrun) per role and node, the workers' first: ranks follow node_rank,
        # so the workers are ranks 0..W-1 and a parameter-server job's servers W..W+S-1, as
        # torchrelay.train.ps expects; a node with workers and servers runs two launches
        launches = [(placement.shape, node_id, nproc) for node_id, nproc in placement.placement]
        launches += [(shape, node_id, nproc) for _, shape, where in placement.roles for node_id, nproc in where]
        world = sum(nproc for _, _, nproc in launches)
        offset = 0
        for node_rank, (shape, node_id, nproc) in enumerate(launches):
            s.add(LaunchRow(
                id=f"{row.id}-a{row.attempt}-n{node_rank}", job_seq=row.seq, attempt=row.attempt, node_id=node_id,
                node_rank=node_rank, nnodes=len(launches), nproc=nproc, rank_offset=offset,
                world_size=world, cpu=shape.cpu, gpu=shape.gpu, memory=shape.memory,
                desired="run", state="pending", ranks=[], stopped=False, message=""))
            offset += nproc
            self.notifier.bump(f"node:{node_id}")
        names = ", ".join(f"{nodes[n].name}×{k}" for n, k in placement.placement)
        granted = placement.shape
        if granted.gpu:
            gpu_types = sorted({nodes[n].gpu_type or "gpu" for n, _ in placement.placement})
            names += f" ({granted.gpu} {'/'.join(gpu_types)} per worker)"
        elif spec.resources.accelerator_mode == "prefer":
            names += " (on CPUs: the gang did not fit on accelerators)"
        for role, _, where in placement.roles:
            names += f"; {role}s on " + ", ".join(f"{nodes[n].name}×{k}" for n, k in where)
        if JobState(row.state) == JobState.QUEUED:
            self._set_state(s, row, JobState.SCHEDULED, f"placed on {names}")
        else:
            s.add(EventRow(job_seq=row.seq, time=self.clock(), state=row.state,
                           message=f"attempt {row.attempt} placed on {names}"))
            self.notifier.bump(f"job:{row.seq}")

    def _fence_checkpoints(self, row: JobRow) -> None:
        """Write the job's new attempt where checkpoint commits look (see torchrelay.train.checkpoint):
        workers of an older attempt still running on a node that lost contact can no longer
        commit or prune. Only restarts need it (attempt 1 has nothing older to fence off)."""
        try:
            self.store.put_bytes(ArtifactStore.attempt_key(row.id), str(row.attempt).encode())
        except (StorageError, OSError) as exc:
            logging.getLogger("torchrelay.server").warning(
                "job %s: could not write the checkpoint fence for attempt %d: %s", row.id, row.attempt, exc)

    # ------------------------------------------------------------ internals: views

    def _assignments(self, conn: Any, node_id: str, node: Any, launches: list[Any]) -> list[LaunchAssignment]:
        """What the agent of ``node_id`` is told of each launch (``launches``: rows of
        ``_live_on_node``; ``node``: its row with address and gpu_type). A launch that is its
        attempt's node 0 is its own head; other heads, and their nodes, are read in one query
        each, only when some launch needs them (a heartbeat reply lists every launch)."""
        if not launches:
            return []
        heads: dict[tuple[int, int], Any] = {}
        addresses = {node_id: node.address}
        peer_seqs = sorted({x.job_seq for x in launches if x.node_rank != 0})
        if peer_seqs:
            table = LaunchRow.__table__
            heads = {(h.job_seq, h.attempt): h for h in conn.execute(
                select(table.c.job_seq, table.c.attempt, table.c.node_id, table.c.master_port)
                .where(table.c.job_seq.in_(peer_seqs), table.c.node_rank == 0))}
            nodes = NodeRow.__table__
            addresses.update(conn.execute(select(nodes.c.id, nodes.c.address)
                                          .where(nodes.c.id.in_({h.node_id for h in heads.values()}))).all())
        out = []
        for launch in launches:
            spec = self._spec_of_conn(conn, launch.job_seq)
            head = launch if launch.node_rank == 0 else heads.get((launch.job_seq, launch.attempt))
            env = dict(self._static_env(launch.job_seq, spec))
            # what was granted, which for accelerator "prefer" may be CPUs although GPUs were asked for
            env["RELAY_ACCELERATOR"] = "gpu" if launch.gpu else "cpu"
            env["RELAY_GPUS_PER_WORKER"] = str(launch.gpu)
            if launch.gpu and node.gpu_type:
                env["RELAY_GPU_TYPE"] = node.gpu_type
            job_id = job_id_of(launch.job_seq)
            out.append(LaunchAssignment(
                launch_id=launch.id, job_id=job_id, attempt=launch.attempt, desired=launch.desired,  # type: ignore[arg-type]
                stop_reason=launch.stop_reason,
                stop_grace_s=spec.stop_grace_s if launch.stop_grace_s is None else launch.stop_grace_s,
                node_rank=launch.node_rank, nnodes=launch.nnodes,
                nproc_per_node=launch.nproc, world_size=launch.world_size, rank_offset=launch.rank_offset,
                master_addr=addresses.get(head.node_id) if head else None,
                master_port=head.master_port if head else None,
                entrypoint=self._argv(launch.job_seq, spec), bundle=launch.bundle, env=env, store_url=self.store.url,
                job_store_prefix=ArtifactStore.job_prefix(job_id)))
        return out

    def _argv(self, seq: int, spec: JobSpec) -> list[str]:
        """The job's entrypoint as argv (split once per job and cached with its spec)."""
        argv = self._argv_cache.get(seq)
        if argv is None:
            argv = self._argv_cache[seq] = spec.argv
        return list(argv)

    def _spec_of_conn(self, conn: Any, seq: int) -> JobSpec:
        """``_spec_of`` on a plain connection."""
        spec = self._spec_cache.get(seq)
        if spec is None:
            data = conn.execute(select(JobRow.__table__.c.spec).where(JobRow.__table__.c.seq == seq)).scalar()
            spec = self._spec_cache[seq] = JobSpec.parse(data)
        return spec

    def _static_env(self, seq: int, spec: JobSpec) -> dict[str, str]:
        """The part of a launch's environment that only depends on the job's spec (cached with it)."""
        env = self._env_cache.get(seq)
        if env is None:
            env = dict(spec.env)
            env["RELAY_STRATEGY"] = json.dumps(spec.strategy.model_dump(mode="json"))
            env["RELAY_CHECKPOINT"] = json.dumps(spec.checkpoint.model_dump(mode="json", by_alias=True))
            env["RELAY_JOB_NAME"] = spec.name
            env["RELAY_WORKERS"] = str(spec.workers)
            self._env_cache[seq] = env
        return env

    def _job_info(self, s: Session, row: JobRow, events: bool = False, names: dict[str, str] | None = None,
                  launches: list[LaunchRow] | None = None) -> JobInfo:
        """The job as the API shows it; ``names`` (node id -> name) and ``launches`` (its current
        attempt's) are read here unless the caller read them for many jobs at once."""
        placement = []
        if row.attempt:
            if names is None:
                names = {n.id: n.name for n in s.scalars(select(NodeRow))}
            if launches is None:
                launches = self._attempt_launches(s, row.seq, row.attempt)
            placement = [PlacementInfo(node_id=x.node_id, node_name=names.get(x.node_id, x.node_id),
                                       node_rank=x.node_rank, workers=x.nproc) for x in launches]
        evs = []
        if events:
            evs = [JobEvent(time=e.time, state=JobState(e.state), message=e.message)
                   for e in s.scalars(select(EventRow).where(EventRow.job_seq == row.seq).order_by(EventRow.id))]
        return JobInfo(
            id=row.id, name=row.name, user=row.user, state=JobState(row.state), spec=row.spec, bundle=row.bundle,
            priority=row.priority, submitted_at=row.submitted_at, started_at=row.started_at,
            finished_at=row.finished_at, attempt=row.attempt, restarts=row.restarts, placement=placement,
            failure=FailureInfo.model_validate(row.failure) if row.failure else None,
            restart_reasons=[FailureInfo.model_validate(x) for x in (row.restart_reasons or [])],
            waiting_reason=row.waiting_reason if JobState(row.state) in (JobState.QUEUED, JobState.RESTARTING) else None,
            last_metrics=row.last_metrics or {}, events=evs)

    def job_count(self) -> int:
        with self._sessions() as s:
            return int(s.scalar(select(func.count()).select_from(JobRow)) or 0)


def _group(items: Iterable, key: Callable) -> list[tuple[str, list]]:
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.items())
