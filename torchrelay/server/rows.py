"""Reading and writing the server's rows: the one module that knows the queries.

``Database`` holds the engine, the one writer lock and the process's ``Cache``, and hands out
units of work: ``with db.write() as rows`` runs one transaction under the lock and, once it
has committed, delivers what it changed to the notifier (its ``Outbox``) while still holding
the lock; ``with db.read() as rows`` reads without the lock. ``Rows`` is one unit's view of the
tables: lookups (raising ``NotFound``), the views the decision modules take, and the writes
that carry out their decisions (every state change checked against its table in
``torchrelay.spec``).

Reads are few and plain where it matters for speed: a scheduling cycle reads plain columns and
every live launch in one query each, a heartbeat reply three queries whatever its size, and
waiting reasons are written with one executemany. ``Cache`` keeps, per job, what its spec
implies (``JobFacts``, parsed once, dropped when the job ends) and the nodes as the policy
sees them (dropped whenever a node changes): see ``cache.py``.
"""
from __future__ import annotations

import contextlib
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.orm import Session

from torchrelay import scheduler as policy
from torchrelay.errors import NotFound
from torchrelay.server.assignment import LaunchPlan, launch_assignment, with_daemons
from torchrelay.server.cache import Cache, JobFacts, NodeFacts
from torchrelay.server.notify import Notifier
from torchrelay.server.scheduling import SCHEDULER_STATES
from torchrelay.server.store import (EventRow, JobRow, LaunchRow, NodeEventRow, NodeRow, make_engine,
                                     make_sessionmaker)
from torchrelay.server.views import (JobView, LaunchView, NodeLiveness, ProgressView, RuntimeView, Stop, StopKind,
                                     job_id_of, job_seq_of)
from torchrelay.spec import (JobSpec, JobState, LaunchState, NodeState, check_launch_transition,
                             check_node_transition, check_transition)
from torchrelay.wire import (EventRecord, FailureInfo, JobEvent, JobInfo, LaunchAssignment, LaunchStatus, NodeInfo,
                             NodeRegistration, PlacementInfo)

_EXITED = LaunchState.EXITED.value
# the launch columns a heartbeat reply is built from (read as plain rows, no ORM objects)
_ASSIGNMENT_COLUMNS = tuple(LaunchRow.__table__.c[name] for name in (
    "id", "job_seq", "attempt", "node_id", "node_rank", "nnodes", "nproc", "rank_offset", "world_size", "gpu",
    "cpu", "memory", "desired", "stop_reason", "state", "master_port", "stop_grace_s", "mpi", "released"))
_BRIEF_COLUMNS = (JobRow.seq, JobRow.name, JobRow.user, JobRow.state, JobRow.submitted_at, JobRow.attempt,
                  JobRow.requeue, JobRow.waiting_reason, JobRow.placed_at)
_LIVE_COLUMNS = (LaunchRow.job_seq, LaunchRow.attempt, LaunchRow.node_id, LaunchRow.nproc, LaunchRow.cpu,
                 LaunchRow.gpu, LaunchRow.memory, LaunchRow.rank_offset, LaunchRow.released, LaunchRow.state)
_CHUNK = 500  # ids per IN (...): well inside every database's limit on bound parameters


class Outbox:
    """What one unit of work changed: notifier keys to bump and whether the control loop should
    run, delivered once the unit has committed (a rolled-back unit notifies nobody)."""

    __slots__ = ("keys", "kick", "nodes_changed")

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.kick = False
        self.nodes_changed = False

    def job_changed(self, seq: int) -> None:
        self.keys.add(f"job:{seq}")


class Database:
    """The store's engine, sessions, writer lock and cache. ``kick``: wakes the control loop."""

    def __init__(self, url: str, notifier: Notifier, kick: Callable[[], None]):
        self.engine = make_engine(url)
        self.sessions = make_sessionmaker(self.engine)
        self.lock = threading.RLock()
        self.cache = Cache()
        self.notifier, self._kick = notifier, kick

    @contextlib.contextmanager
    def write(self) -> Iterator[Rows]:
        """One transaction under the writer lock; its outbox is delivered after the commit,
        before the lock is released. Blocks on the lock."""
        with self.lock:
            outbox = Outbox()
            try:
                with self.sessions.begin() as s:
                    yield Rows(s, self.cache, outbox)
            except BaseException:
                self.cache.drop_nodes()  # node facts may have been read from rows rolled back
                raise
            self._deliver(outbox)

    @contextlib.contextmanager
    def read(self) -> Iterator[Rows]:
        """A session for reads only, without the lock (it sees committed rows)."""
        with self.sessions() as s:
            yield Rows(s, self.cache, Outbox())

    def _deliver(self, outbox: Outbox) -> None:
        if outbox.nodes_changed:
            self.cache.drop_nodes()
        for key in outbox.keys:
            self.notifier.bump(key)
        if outbox.kick:
            self._kick()

    def dispose(self) -> None:
        self.engine.dispose()


@dataclass(frozen=True, slots=True)
class JobBrief:
    """The columns of a job row one scheduling cycle needs (read without building ORM objects)."""

    seq: int
    name: str
    user: str | None
    state: str
    submitted_at: float
    attempt: int
    requeue: bool | None
    waiting_reason: str | None
    placed_at: float | None

    @property
    def id(self) -> str:
        return job_id_of(self.seq)


class Rows:
    """One unit of work's reads and writes. Writes record what to notify in ``outbox``."""

    def __init__(self, session: Session, cache: Cache, outbox: Outbox):
        self.s, self.cache, self.outbox = session, cache, outbox

    @property
    def conn(self) -> Any:
        """The unit's connection, for Core reads (they do not flush the session: ``flush`` first)."""
        return self.s.connection()

    def flush(self) -> None:
        self.s.flush()

    # ------------------------------------------------------------ jobs

    def job(self, job_id: str) -> JobRow:
        """The job's row. Raises NotFound naming the id."""
        seq = job_seq_of(job_id)
        row = self.s.get(JobRow, seq) if seq is not None else None
        if row is None:
            raise NotFound(f"job {job_id!r} does not exist; `relay ls` lists the jobs")
        return row

    def job_by_seq(self, seq: int) -> JobRow:
        return self.s.get(JobRow, seq)

    def facts(self, seq: int) -> JobFacts:
        """The job's facts; its spec column is read only when this process has not parsed it."""
        facts = self.cache.jobs.get(seq)
        return facts if facts is not None else facts_of(self.conn, self.cache, seq)

    def job_view(self, row: JobRow) -> JobView:
        hung = row.failure if row.hung_attempt == row.attempt else None
        return JobView(id=row.id, state=JobState(row.state), attempt=row.attempt, restarts=row.restarts,
                       max_restarts=self.facts(row.seq).spec.max_restarts, requeue=bool(row.requeue),
                       hung_failure=FailureInfo.model_validate(hung) if hung else None)

    def set_state(self, row: JobRow, target: JobState, message: str, now: float) -> None:
        """Move the job to ``target`` with an event; no-op when it is there. Raises Conflict
        when the change is not in ``torchrelay.spec.TRANSITIONS``."""
        current = JobState(row.state)
        if current == target:
            return
        check_transition(row.id, current, target)
        row.state = target.value
        if target == JobState.RUNNING and row.started_at is None:
            row.started_at = now
        if target.terminal:
            row.finished_at = now
            row.waiting_reason = None
            self.cache.jobs.pop(row.seq, None)  # a finished job is never scheduled again
        self.s.add(EventRow(job_seq=row.seq, time=now, state=target.value, message=message))
        self.outbox.keys.update((f"job:{row.seq}", f"logs:{row.seq}", f"metrics:{row.seq}", "jobs",
                                 f"events:{row.seq}", "events"))
        if target.terminal or target in (JobState.QUEUED, JobState.RESTARTING):
            self.outbox.kick = True

    def add_event(self, row: JobRow, message: str, now: float, kind: str | None = None,
                  detail: dict | None = None) -> None:
        """An event in the job's current state; ``kind`` "checkpoint" with its ``detail`` for a
        checkpoint commit (``server.events.model``)."""
        self.s.add(EventRow(job_seq=row.seq, time=now, state=row.state, message=message, kind=kind, detail=detail))
        self.outbox.job_changed(row.seq)
        self.outbox.keys.update((f"events:{row.seq}", "events"))

    def event_details(self, row: JobRow, kind: str) -> list[dict]:
        """The ``detail`` of each of the job's events of ``kind``, oldest first."""
        q = select(EventRow.detail).where(EventRow.job_seq == row.seq, EventRow.kind == kind).order_by(EventRow.id)
        return [d for d in self.s.scalars(q) if d is not None]

    def placed(self, row: JobRow, plans: Sequence[LaunchPlan], now: float, mpi: dict | None = None) -> None:
        """Start the job's next attempt on ``plans`` (``row.attempt`` already counts it); ``mpi``:
        an mpirun job's world, kept on its node 0 launch."""
        row.waiting_reason = None
        row.last_progress_at = None
        row.placed_at = now
        self._add_launches(row, plans, mpi)

    def add_launches(self, row: JobRow, plans: Sequence[LaunchPlan]) -> None:
        """Add ``plans`` (a grown elastic job's joiners: ``assignment.grow_launches``) to the job's
        current attempt, whose other launches' ``nnodes`` become theirs; nothing else of the
        job changes (its ``placed_at`` stays)."""
        for launch in self.attempt_launches(row.seq, row.attempt):
            launch.nnodes = plans[0].nnodes
        self._add_launches(row, plans, None)

    def _add_launches(self, row: JobRow, plans: Sequence[LaunchPlan], mpi: dict | None) -> None:
        for plan in plans:
            self.s.add(LaunchRow(
                id=plan.id, job_seq=row.seq, attempt=row.attempt, node_id=plan.node_id, node_rank=plan.node_rank,
                nnodes=plan.nnodes, nproc=plan.nproc, rank_offset=plan.rank_offset, world_size=plan.world_size,
                cpu=plan.shape.cpu, gpu=plan.shape.gpu, memory=plan.shape.memory, desired="run",
                state=LaunchState.PENDING.value, ranks=[], stopped=False, message="",
                mpi=mpi if plan.node_rank == 0 else None))
            self.outbox.keys.add(f"node:{plan.node_id}")

    def set_waiting_reasons(self, reasons: Iterable[tuple[int, str]]) -> None:
        """(job seq, reason) for each job whose reason changed: one executemany."""
        changed = [{"b_seq": seq, "b_reason": reason} for seq, reason in reasons]
        if changed:
            self.s.connection().execute(
                update(JobRow.__table__).where(JobRow.__table__.c.seq == bindparam("b_seq"))
                .values(waiting_reason=bindparam("b_reason")), changed)

    def insert_jobs(self, specs: Sequence[tuple[JobSpec, dict[str, Any], str | None]], now: float) -> list[int]:
        """Insert QUEUED jobs (spec, its public form, bundle) and their "submitted" events in
        two statements; returns their seqs in the order given."""
        # Core inserts: the ORM's unit of work and a read-back cost more than the inserts
        # themselves (see bench/scheduler.py part b)
        conn = self.conn
        rows = [dict(name=spec.name, user=spec.user, state=JobState.QUEUED.value, spec=public, bundle=bundle,
                     priority=spec.priority, submitted_at=now, attempt=0, restarts=0, restart_reasons=[],
                     last_metrics={}, requeue=False) for spec, public, bundle in specs]
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
        return seqs

    # ------------------------------------------------------------ launches

    def attempt_launches(self, seq: int, attempt: int) -> list[LaunchRow]:
        return list(self.s.scalars(select(LaunchRow).where(LaunchRow.job_seq == seq, LaunchRow.attempt == attempt)
                                   .order_by(LaunchRow.node_rank)))

    def live_launches(self, row: JobRow) -> list[LaunchRow]:
        return [x for x in self.attempt_launches(row.seq, row.attempt) if x.state != _EXITED]

    def launches_with_jobs(self, launch_ids: set[str]) -> list[Any]:
        """(LaunchRow, JobRow) of each known launch in ``launch_ids``: one query. Hold the
        result while using ``s.get`` on them: the session only keeps objects referenced elsewhere."""
        return list(self.s.execute(select(LaunchRow, JobRow).join(JobRow, JobRow.seq == LaunchRow.job_seq)
                                   .where(LaunchRow.id.in_(launch_ids))))

    def launch(self, launch_id: str) -> LaunchRow | None:
        return self.s.get(LaunchRow, launch_id)

    def launch_views(self, launches: Iterable[LaunchRow]) -> list[LaunchView]:
        names = self.nodes().names
        return [LaunchView(
            id=x.id, attempt=x.attempt, node_id=x.node_id, node_rank=x.node_rank, state=LaunchState(x.state),
            node_name=names.get(x.node_id), desired=x.desired, stop_kind=StopKind(x.stop_kind) if x.stop_kind else None,
            stop_reason=x.stop_reason, succeeded=x.succeeded, stopped=bool(x.stopped), infra=bool(x.infra),
            message=x.message or "", ranks=tuple(x.ranks or ())) for x in launches]

    def stop_launches(self, row: JobRow, stop: Stop, *, no_grace: bool = False) -> None:
        """Tell the agents of the job's live launches to stop (those not told already);
        ``no_grace``: SIGKILL right after SIGTERM."""
        for launch in self.live_launches(row):
            if no_grace:
                launch.stop_grace_s = 0.0
            if launch.desired != "stop":
                launch.desired, launch.stop_reason, launch.stop_kind = "stop", stop.reason, stop.kind.value
                self.outbox.keys.add(f"node:{launch.node_id}")

    def release_ranks(self, launch: LaunchRow, ranks: Sequence[int]) -> None:
        """Tell the agent of a live elastic launch that ``ranks`` (global) are to leave (a shrink)."""
        launch.released = sorted({*(launch.released or ()), *ranks})
        self.outbox.keys.add(f"node:{launch.node_id}")

    def advance_launch(self, launch: LaunchRow, target: LaunchState) -> None:
        """Record the launch in ``target``. Raises Conflict when the table refuses the change."""
        check_launch_transition(launch.id, LaunchState(launch.state), target)
        launch.state = target.value

    def record_exit(self, launch: LaunchRow, status: LaunchStatus, *, stopped: bool, infra: bool) -> None:
        self.advance_launch(launch, LaunchState.EXITED)
        launch.ranks = [r.model_dump() for r in status.ranks]
        launch.succeeded = bool(status.succeeded)
        launch.stopped = stopped
        launch.message = status.message
        launch.infra = infra
        self.outbox.keys.add(f"node:{launch.node_id}")
        self.outbox.kick = True

    def set_master_port(self, launch: LaunchRow, port: int) -> None:
        """Record node 0's rendezvous port; the attempt's peers wait for it."""
        launch.master_port = port
        self._peers_changed(launch)

    def set_mpi_daemons(self, launch: LaunchRow, daemons: dict[int, str]) -> None:
        """Record the Open MPI daemons node 0's mpirun handed over; each peer waits for its own."""
        launch.mpi = with_daemons(launch.mpi, daemons)
        self._peers_changed(launch)

    def _peers_changed(self, launch: LaunchRow) -> None:
        if launch.nnodes > 1:  # a launch alone in its attempt has no peer
            for peer in self.attempt_launches(launch.job_seq, launch.attempt):
                self.outbox.keys.add(f"node:{peer.node_id}")

    def live_on_node_orm(self, node_id: str) -> list[LaunchRow]:
        return list(self.s.scalars(select(LaunchRow).where(LaunchRow.node_id == node_id, LaunchRow.state != _EXITED)))

    def live_by_job(self) -> dict[int, list[Any]]:
        """Every live launch (plain rows of the columns a cycle needs), by job seq, in node_rank order."""
        out: dict[int, list[Any]] = {}
        for launch in self.s.execute(select(*_LIVE_COLUMNS).where(LaunchRow.state != _EXITED)
                                     .order_by(LaunchRow.job_seq, LaunchRow.node_rank)):
            out.setdefault(launch.job_seq, []).append(launch)
        return out

    def scheduled_jobs(self) -> list[JobBrief]:
        """The jobs a cycle considers (waiting, or holding nodes), as plain columns."""
        states = [s.value for s in SCHEDULER_STATES]
        return [JobBrief(*row) for row in
                self.s.execute(select(*_BRIEF_COLUMNS).where(JobRow.state.in_(states)).order_by(JobRow.seq))]

    def load_jobs(self, seqs: Sequence[int]) -> list[JobRow]:
        """The jobs' rows in few queries (hold the list while ``s.get`` finds them loaded)."""
        loaded: list[JobRow] = []
        for chunk in range(0, len(seqs), _CHUNK):
            loaded += self.s.scalars(select(JobRow).where(JobRow.seq.in_(seqs[chunk:chunk + _CHUNK])))
        return loaded

    # ------------------------------------------------------------ watchdog views

    def progress_views(self) -> list[ProgressView]:
        """RUNNING jobs that have reported a metric in their current attempt."""
        rows = self.s.execute(select(JobRow.seq, JobRow.attempt, JobRow.last_progress_at)
                              .where(JobRow.state == JobState.RUNNING.value, JobRow.last_progress_at.is_not(None)))
        return [ProgressView(seq=seq, attempt=attempt, last_progress_at=at,
                             hang_timeout_s=self.facts(seq).spec.hang_timeout_s) for seq, attempt, at in rows]

    def runtime_views(self) -> list[RuntimeView]:
        """Active jobs that declare ``max_runtime_s`` (most declare none: no launch is read for them)."""
        states = (JobState.SCHEDULED.value, JobState.RUNNING.value, JobState.RESTARTING.value)
        limited = [(row, limit) for row in self.s.execute(
            select(JobRow.seq, JobRow.attempt, JobRow.placed_at, JobRow.requeue).where(JobRow.state.in_(states)))
            if (limit := self.facts(row.seq).spec.max_runtime_s)]
        if not limited:
            return []
        stoppable = {(seq, attempt) for seq, attempt in self.s.execute(
            select(LaunchRow.job_seq, LaunchRow.attempt).where(
                LaunchRow.job_seq.in_([row.seq for row, _ in limited]), LaunchRow.state != _EXITED,
                LaunchRow.desired != "stop"))}
        return [RuntimeView(seq=row.seq, attempt=row.attempt, max_runtime_s=limit, placed_at=row.placed_at,
                            requeue=bool(row.requeue), stoppable=(row.seq, row.attempt) in stoppable)
                for row, limit in limited]

    def liveness(self) -> list[NodeLiveness]:
        return [NodeLiveness(id=i, name=name, state=NodeState(state), last_seen=seen) for i, name, state, seen in
                self.s.execute(select(NodeRow.id, NodeRow.name, NodeRow.state, NodeRow.last_seen)
                               .where(NodeRow.state == NodeState.READY.value))]

    # ------------------------------------------------------------ nodes

    def nodes(self) -> NodeFacts:
        """Every node as the policy sees it (LOST ones are not ready, so a job that fits them
        waits for them instead of being called unschedulable), with names; cached."""
        def load() -> NodeFacts:
            self.s.flush()  # a node this unit changed must be read as changed (Core reads do not autoflush)
            return node_facts(self.conn)

        return self.cache.nodes(load)

    def nodes_changed(self) -> None:
        self.cache.drop_nodes()
        self.outbox.nodes_changed = True

    def node(self, node_id: str) -> NodeRow | None:
        return self.s.get(NodeRow, node_id)

    def set_node_state(self, node: NodeRow, target: NodeState, now: float | None = None) -> None:
        """Raises Conflict when ``torchrelay.spec.NODE_TRANSITIONS`` refuses the change. The
        change is recorded (``node_events``, what ``--events`` sinks send) at ``now``."""
        if node.state != target.value:
            check_node_transition(node.id, NodeState(node.state), target)
            node.state = target.value
            self.nodes_changed()
            self._node_event(node, now if now is not None else node.last_seen)

    def _node_event(self, node: NodeRow, now: float) -> None:
        self.s.add(NodeEventRow(node_id=node.id, node_name=node.name, time=now, state=node.state))

    def register_node(self, reg: NodeRegistration, now: float, problem: str | None = None) -> str:
        """Add the node, or update a known one (same node_id) and make it READY, with ``problem``
        (``reachability.problem_of``: None, or why it gets no work). Returns its id."""
        node = self.s.get(NodeRow, reg.node_id) if reg.node_id else None
        if node is None:
            node = NodeRow(id=reg.node_id or f"node-{uuid.uuid4().hex[:8]}", name=reg.name, address=reg.address,
                           cpus=reg.cpus, gpus=reg.gpus, gpu_type=reg.gpu_type, memory=reg.memory,
                           labels=reg.labels, state=NodeState.READY.value, last_seen=now, problem=problem)
            self.s.add(node)
            self._node_event(node, now)
        else:
            node.name, node.address, node.cpus, node.gpus = reg.name, reg.address, reg.cpus, reg.gpus
            node.gpu_type, node.memory, node.labels = reg.gpu_type, reg.memory, reg.labels
            node.problem = problem
            self.set_node_state(node, NodeState.READY, now)
            node.last_seen = now
        self.nodes_changed()
        self.outbox.keys.add(f"node:{node.id}")
        self.outbox.kick = True
        return node.id

    def node_seen(self, node_id: str, now: float) -> Any:
        """Record a heartbeat: the node is seen now and, if it was LOST, READY again. Returns
        its ``node_for_reply`` row as it was before. Raises NotFound for an unknown node."""
        nodes = NodeRow.__table__
        node = node_for_reply(self.conn, node_id)
        back = node.state == NodeState.LOST.value
        if back:
            check_node_transition(node_id, NodeState.LOST, NodeState.READY)
            self.nodes_changed()
            self.outbox.kick = True
        self.conn.execute(update(nodes).where(nodes.c.id == node_id)
                          .values(last_seen=now, **({"state": NodeState.READY.value} if back else {})))
        return node

    def refresh_nodes_seen(self, now: float) -> None:
        """Every READY node is seen now, at the latest (a restarted server gives agents a timeout's grace)."""
        for node in self.s.scalars(select(NodeRow).where(NodeRow.state == NodeState.READY.value)):
            node.last_seen = max(node.last_seen, now)

    # ------------------------------------------------------------ API views

    def job_info(self, row: JobRow, events: bool = False, launches: list[LaunchRow] | None = None) -> JobInfo:
        """The job as the API shows it; ``launches`` (its current attempt's) are read here
        unless the caller read them for many jobs at once."""
        placement = []
        if row.attempt:
            names = self.nodes().names
            if launches is None:
                launches = self.attempt_launches(row.seq, row.attempt)
            placement = [PlacementInfo(node_id=x.node_id, node_name=names.get(x.node_id, x.node_id),
                                       node_rank=x.node_rank, workers=x.nproc) for x in launches]
        evs = []
        if events:
            evs = [JobEvent(time=e.time, state=JobState(e.state), message=e.message) for e in
                   self.s.scalars(select(EventRow).where(EventRow.job_seq == row.seq).order_by(EventRow.id))]
        state = JobState(row.state)
        return JobInfo(
            id=row.id, name=row.name, user=row.user, state=state, spec=row.spec, bundle=row.bundle,
            priority=row.priority, submitted_at=row.submitted_at, started_at=row.started_at,
            finished_at=row.finished_at, attempt=row.attempt, restarts=row.restarts, placement=placement,
            failure=FailureInfo.model_validate(row.failure) if row.failure else None,
            restart_reasons=[FailureInfo.model_validate(x) for x in (row.restart_reasons or [])],
            waiting_reason=row.waiting_reason if state in (JobState.QUEUED, JobState.RESTARTING) else None,
            last_metrics=row.last_metrics or {}, events=evs)

    def list_jobs(self, states: Sequence[str], limit: int, user: str | None = None) -> list[JobInfo]:
        """The newest ``limit`` jobs (in ``states`` unless empty; ``user``'s only, when given), newest first."""
        q = select(JobRow).order_by(JobRow.seq.desc()).limit(limit)
        if states:
            q = q.where(JobRow.state.in_(states))
        if user is not None:
            q = q.where(JobRow.user == user)
        rows = list(self.s.scalars(q))
        # placements for the whole page in few queries, not one per job
        placed: dict[tuple[int, int], list[LaunchRow]] = {}
        placed_seqs = [row.seq for row in rows if row.attempt]
        for chunk in range(0, len(placed_seqs), _CHUNK):
            for x in self.s.scalars(select(LaunchRow).where(LaunchRow.job_seq.in_(placed_seqs[chunk:chunk + _CHUNK]))
                                    .order_by(LaunchRow.node_rank)):
                placed.setdefault((x.job_seq, x.attempt), []).append(x)
        return [self.job_info(row, launches=placed.get((row.seq, row.attempt), [])) for row in rows]

    def events_after(self, after: int, job_seq: int | None, limit: int) -> list[EventRecord]:
        """Event rows with id > ``after`` (of one job, or of all), in id order, at most ``limit``."""
        q = (select(EventRow, JobRow.name).join(JobRow, JobRow.seq == EventRow.job_seq)
             .where(EventRow.id > after).order_by(EventRow.id).limit(limit))
        if job_seq is not None:
            q = q.where(EventRow.job_seq == job_seq)
        return [EventRecord(id=e.id, job_id=job_id_of(e.job_seq), job_name=name, time=e.time, state=JobState(e.state),
                            message=e.message) for e, name in self.s.execute(q)]

    def job_counts(self) -> list[tuple[str, str | None, int]]:
        """(state, user, number of jobs) for every pair that has jobs."""
        q = select(JobRow.state, JobRow.user, func.count()).group_by(JobRow.state, JobRow.user)
        return [(state, user, n) for state, user, n in self.s.execute(q)]

    def waiting_reasons(self) -> list[str | None]:
        """Why each waiting (QUEUED or RESTARTING) job waits (None: not yet considered)."""
        q = select(JobRow.waiting_reason).where(JobRow.state.in_((JobState.QUEUED.value, JobState.RESTARTING.value)))
        return list(self.s.scalars(q))

    def last_event_id(self) -> int:
        return self.s.scalar(select(func.max(EventRow.id))) or 0

    def node_infos(self) -> list[NodeInfo]:
        out = []
        for node in self.s.scalars(select(NodeRow).order_by(NodeRow.name, NodeRow.id)):
            live = self.live_on_node_orm(node.id)
            out.append(NodeInfo(
                id=node.id, name=node.name, address=node.address, state=node.state,  # type: ignore[arg-type]
                cpus=node.cpus, gpus=node.gpus, gpu_type=node.gpu_type, memory=node.memory,
                labels=node.labels or {}, last_seen=node.last_seen,
                used_cpus=sum(x.cpu * x.nproc for x in live), used_gpus=sum(x.gpu * x.nproc for x in live),
                used_memory=sum(x.memory * x.nproc for x in live), launches=[x.id for x in live], note=node.note,
                problem=node.problem))
        return out


# ---------------------------------------------------------------- plain-connection reads
# (a heartbeat reply is also built outside any session, on a bare connection)


def facts_of(conn: Any, cache: Cache, seq: int) -> JobFacts:
    facts = cache.jobs.get(seq)
    if facts is None:
        data = conn.execute(select(JobRow.__table__.c.spec).where(JobRow.__table__.c.seq == seq)).scalar()
        facts = cache.jobs[seq] = JobFacts(seq, JobSpec.from_stored(data))
    return facts


def node_facts(conn: Any) -> NodeFacts:
    views, names, gpu_types = [], {}, {}
    nodes = NodeRow.__table__
    for n in conn.execute(select(nodes).order_by(nodes.c.id)):
        views.append(policy.NodeView(id=n.id, cpus=n.cpus, gpus=n.gpus, memory=n.memory, gpu_type=n.gpu_type,
                                     labels=tuple(sorted((n.labels or {}).items())),
                                     ready=n.state == NodeState.READY.value and not n.problem))
        names[n.id], gpu_types[n.id] = n.name, n.gpu_type
    return NodeFacts(views=tuple(views), names=names, gpu_types=gpu_types)


def node_assignments(conn: Any, cache: Cache, node: Any, live: Sequence[Any], store: Any) -> list[LaunchAssignment]:
    """What the agent of ``node`` (its row from ``node_for_reply``, with ``id``) is told of each
    of its ``live`` launches (rows of ``live_on_node``): a heartbeat reply lists every one.
    ``store``: the ``ArtifactStore`` (its URL and public options, never its credentials)."""
    if not live:
        return []
    heads = masters(conn, node.id, node.address, live)
    out = []
    for launch in live:
        facts = facts_of(conn, cache, launch.job_seq)
        out.append(launch_assignment(
            launch, job_id=job_id_of(launch.job_seq), argv=facts.argv(),
            env=facts.worker_env(launch.gpu, node.gpu_type), spec_stop_grace_s=facts.spec.stop_grace_s,
            master=heads.get((launch.job_seq, launch.attempt), (None, None)), store_url=store.url,
            store_options=store.public_options, launcher=facts.spec.launcher))
    return out


def node_for_reply(conn: Any, node_id: str) -> Any:
    """The node's (id, state, address, gpu_type). Raises NotFound for an unknown node."""
    nodes = NodeRow.__table__
    node = conn.execute(select(nodes.c.id, nodes.c.state, nodes.c.address, nodes.c.gpu_type)
                        .where(nodes.c.id == node_id)).first()
    if node is None:
        raise NotFound(f"node {node_id} is not registered; register it again")
    return node


def touch_node(conn: Any, node_id: str, now: float, *, unless_seen_after: float) -> None:
    """Record a READY node as seen ``now``, unless it was seen after ``unless_seen_after``."""
    nodes = NodeRow.__table__
    conn.execute(update(nodes).where(nodes.c.id == node_id, nodes.c.state == NodeState.READY.value,
                                     nodes.c.last_seen < unless_seen_after).values(last_seen=now))


def live_on_node(conn: Any, node_id: str) -> list[Any]:
    """The node's launches that have not exited, with their job's bundle: plain rows, one query."""
    launches, jobs = LaunchRow.__table__, JobRow.__table__
    return conn.execute(select(*_ASSIGNMENT_COLUMNS, jobs.c.bundle)
                        .join(jobs, jobs.c.seq == launches.c.job_seq)
                        .where(launches.c.node_id == node_id, launches.c.state != _EXITED)
                        .order_by(launches.c.job_seq, launches.c.id)).all()


def masters(conn: Any, node_id: str, node_address: str, launches: Sequence[Any]) -> dict[tuple[int, int], tuple]:
    """(job seq, attempt) -> (address, port, MPI world) of each launch's attempt's node 0 (its
    head). A launch that is node 0 is its own head; other heads and their nodes are read in one
    query each, only when some launch needs them."""
    out = {(x.job_seq, x.attempt): (node_address, x.master_port, x.mpi) for x in launches if x.node_rank == 0}
    peer_seqs = sorted({x.job_seq for x in launches if x.node_rank != 0})
    if peer_seqs:
        table = LaunchRow.__table__
        heads = conn.execute(select(table.c.job_seq, table.c.attempt, table.c.node_id, table.c.master_port,
                                    table.c.mpi)
                             .where(table.c.job_seq.in_(peer_seqs), table.c.node_rank == 0)).all()
        nodes = NodeRow.__table__
        addresses = {node_id: node_address}
        addresses.update(conn.execute(select(nodes.c.id, nodes.c.address)
                                      .where(nodes.c.id.in_({h.node_id for h in heads}))).all())
        for h in heads:
            out.setdefault((h.job_seq, h.attempt), (addresses.get(h.node_id), h.master_port, h.mpi))
    return out
