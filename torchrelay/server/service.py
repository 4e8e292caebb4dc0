"""The cluster's public operations: jobs, nodes, launches, logs, metrics, over one store.

``ClusterService`` is what the HTTP routes call. Every method that changes something is one
short transaction under the store's one writer lock (SQLite allows one writer; one server
process owns the state) and never blocks on the network; reads run without the lock. Long-polls
are done by ``longpoll`` with the ``notifier`` keys:

    "node:<id>"   the node's desired launches changed      (heartbeat long-poll)
    "logs:<seq>"  new log lines of a job                    (logs -f)
    "metrics:<seq>", "job:<seq>", "jobs"                    (metrics / status follow)
    "events:<seq>", "events"  a job's / any job's new event row    (event streams)

``tick()`` is the control loop's one step (``control.Control``); ``start()`` runs it in a
background thread whenever something changes, and at least every ``tick_s``.

This module is a facade: the rules are decided in ``lifecycle`` (job states from launch
reports), ``failures`` (restart or fail, and whom to blame), ``watchdogs`` (lost nodes, hangs,
runtime overruns) and the scheduling policy; ``control`` carries the decisions out;
``submissions`` owns the group commit of new jobs; ``rows`` and ``telemetry`` own the queries;
``assignment`` builds what an agent is told of a launch.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from torchrelay import scheduler as policy
from torchrelay.errors import InvalidSpec, NotFound
from torchrelay.server import heartbeats, telemetry
from torchrelay.server.control import Control
from torchrelay.server.events.model import checkpoint_detail, checkpoint_message
from torchrelay.server.executors import Executor, Executors
from torchrelay.server.notify import Notifier
from torchrelay.server.quotas import QuotaTable
from torchrelay.server.reachability import problem_of
from torchrelay.server.rows import Database
from torchrelay.server.scheduling import queue_rows
from torchrelay.server.submissions import Submissions
from torchrelay.spec import JobState
from torchrelay.storage import ArtifactStore
from torchrelay.storage.keys import checkpoint_file_key
from torchrelay.wire import (ArtifactInfo, EventRecord, Heartbeat, HeartbeatReply, JobInfo, LaunchStatus, LogBatch, LogPage,
                             MetricBatch, MetricPage, NodeInfo, NodeRegistration, RegisterReply)

_log = logging.getLogger("torchrelay.server")


class ClusterService:
    """Owns the store; see the module docstring for the contract."""

    def __init__(self, db_url: str, store_url: str | ArtifactStore, *, heartbeat_timeout_s: float = 10.0,
                 tick_s: float = 0.5, clock: Callable[[], float] = time.time, quotas: QuotaTable | None = None,
                 executors: Iterable[Executor] = ()):
        self.notifier = Notifier()
        self.store = store_url if isinstance(store_url, ArtifactStore) else ArtifactStore(store_url)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.tick_s = tick_s
        self.clock = clock
        self.quotas = quotas or QuotaTable()
        self.executors = Executors(executors)  # the agents, and e.g. a Slurm partition
        self.db = Database(db_url, self.notifier, kick=self._kick)
        self.control = Control(self.db, self.store, quotas=self.quotas, heartbeat_timeout_s=heartbeat_timeout_s,
                               tick_s=tick_s, clock=clock)
        self.submissions = Submissions(self.db, self.store, clock, self.executors)
        self.executors.attach(self)

    def _kick(self) -> None:
        self.control.kick()
        self.executors.kick()

    @property
    def engine(self) -> Any:
        return self.db.engine

    # ------------------------------------------------------------ background loop

    def start(self) -> None:
        """Run ``tick`` in a daemon thread until ``stop``. Idempotent.

        Every READY node gets a fresh heartbeat timeout first: after a server restart its
        agent needs that long to find the server again before the node counts as LOST."""
        if self.control.started:
            return
        with self.db.write() as rows:
            rows.refresh_nodes_seen(self.clock())
        self.control.start()
        self.executors.start()

    def stop(self) -> None:
        """End the loops, write the submissions already accepted, close the store."""
        self.executors.stop()
        self.control.stop()
        self.submissions.close()
        self.db.dispose()

    def tick(self) -> None:
        """One control-loop step: watchdogs, then one scheduling cycle. Idempotent."""
        self.control.tick()

    # ------------------------------------------------------------ jobs

    def submit(self, spec_data: dict[str, Any], bundle: str | None, user: str | None) -> JobInfo:
        """Validate and queue a job; returns once it is committed to the store. Blocks (the
        write); any thread. Raises InvalidSpec, NotFound (bundle), Unschedulable."""
        return self.submissions.submit(spec_data, bundle, user)

    async def submit_async(self, spec_data: dict[str, Any], bundle: str | None, user: str | None) -> JobInfo:
        """``submit`` for an event loop: the same contract, and the loop is never blocked;
        concurrent submissions share one commit (``submissions``)."""
        return await self.submissions.submit_async(spec_data, bundle, user)

    def dryrun(self, spec_data: dict[str, Any], user: str | None) -> dict[str, Any]:
        """What submitting the spec would do (its executor's submission text), submitting
        nothing. Raises InvalidSpec, Unschedulable."""
        ticket = self.submissions.validated(spec_data, None, user)
        return self.executors.dryrun(ticket.spec, "job-0")

    def list_jobs(self, state: str | None = None, limit: int = 100, user: str | None = None) -> list[JobInfo]:
        """The newest jobs first (``user``'s only, when given), at most ``limit``; ``state``: comma-separated states to keep.
        Raises InvalidSpec naming a state that is not one."""
        states = [x.strip().upper() for x in (state or "").split(",") if x.strip()]
        bad = [x for x in states if x not in JobState.__members__]
        if bad:
            raise InvalidSpec(f"state {bad[0]!r} is not a job state; use one of {', '.join(JobState.__members__)}")
        with self.db.read() as rows:
            return rows.list_jobs(states, max(1, min(limit, 10000)), user)

    def get_job(self, job_id: str) -> JobInfo:
        """The job with its events. Raises NotFound."""
        with self.db.read() as rows:
            return rows.job_info(rows.job(job_id), events=True)

    def job_state(self, job_id: str) -> tuple[int, JobState]:
        """(seq, state) of the job. Raises NotFound."""
        with self.db.read() as rows:
            row = rows.job(job_id)
            return row.seq, JobState(row.state)

    def cancel(self, job_id: str, checkpoint: bool = True) -> JobInfo:
        """Cancel a job; idempotent (a finished job is returned unchanged). Raises NotFound.

        Workers get SIGTERM, then SIGKILL after the job's ``stop_grace_s``, in which a
        cooperating script commits a checkpoint (``checkpoint=True``); ``checkpoint=False``
        kills them at once."""
        with self.db.write() as rows:
            row = rows.job(job_id)
            self.control.cancel(rows, row, checkpoint, self.clock())
            return rows.job_info(row, events=True)

    def queue_view(self) -> list[dict[str, Any]]:
        """The waiting jobs in the order the policy considers them, each with why it waits and,
        where declared max runtimes allow, its estimated start. Changes nothing."""
        with self.db.lock, self.db.read() as rows:
            inp, waiting = self.control.scheduler_input(rows, self.clock())
            if not inp.queue:
                return []
            decisions = policy.schedule(inp)
        return queue_rows(decisions, inp.queue, {job_id: (row, facts.spec) for job_id, (row, facts) in waiting.items()})

    def logs(self, job_id: str, after: int = 0, rank: int | None = None, limit: int = 5000) -> LogPage:
        with self.db.read() as rows:
            return telemetry.log_page(rows.s, rows.job(job_id), after, rank, limit)

    def metrics(self, job_id: str, after: int = 0, limit: int = 10000) -> MetricPage:
        with self.db.read() as rows:
            return telemetry.metric_page(rows.s, rows.job(job_id), after, limit)

    def events(self, after: int = 0, job_id: str | None = None, limit: int = 1000) -> tuple[list[EventRecord], JobState | None]:
        """Events with id > ``after``, of one job (and its state) or of every job (state None).
        Raises NotFound."""
        with self.db.read() as rows:
            row = rows.job(job_id) if job_id is not None else None
            events = rows.events_after(after, row.seq if row else None, limit)
            return events, JobState(row.state) if row else None

    def last_event_id(self) -> int:
        """The newest event row's id (0 when there is none)."""
        with self.db.read() as rows:
            return rows.last_event_id()

    def ingest_logs(self, job_id: str, batch: LogBatch) -> int:
        """Store new log records; resent ones (seq already seen) are skipped. Returns rows added."""
        with self.db.write() as rows:
            row = rows.job(job_id)
            added = telemetry.add_logs(rows.s, row, batch)
            if added:
                rows.outbox.keys.add(f"logs:{row.seq}")
        return added

    def ingest_metrics(self, job_id: str, batch: MetricBatch) -> int:
        """Store new metric points (resends skipped); updates the job's last metrics and, while
        its attempt runs, its progress clock (hang detection). Returns points added."""
        with self.db.write() as rows:
            row = rows.job(job_id)
            fresh = telemetry.add_metrics(rows.s, row, batch)
            if fresh:  # the job row changes after the read of its launches: one UPDATE at commit
                if rows.live_launches(row):
                    row.last_progress_at = self.clock()
                row.last_metrics = telemetry.last_metrics(row.last_metrics, fresh)
                rows.outbox.keys.update((f"metrics:{row.seq}", f"job:{row.seq}"))
        return len(fresh)

    def checkpoint_committed(self, job_id: str, attempt: int, step: int, url: str) -> bool:
        """Record a checkpoint the job's ``attempt`` committed as a job event (kind
        ``checkpoint``, which the events feed sends as ``job.<id>.checkpoint``). Idempotent:
        the same commit again adds nothing (False). Raises NotFound, InvalidSpec (a bad step or url)."""
        try:
            detail = checkpoint_detail(step, attempt, url)
        except ValueError as exc:
            raise InvalidSpec(str(exc)) from None
        with self.db.write() as rows:
            row = rows.job(job_id)
            if detail in rows.event_details(row, "checkpoint"):
                return False
            rows.add_event(row, checkpoint_message(step, attempt, url), self.clock(), kind="checkpoint", detail=detail)
        return True

    # ------------------------------------------------------------ bundles and artifacts

    def put_bundle(self, digest: str, data: bytes) -> None:
        """Store a workdir bundle under its digest; idempotent (content addressed)."""
        key = ArtifactStore.bundle_key(digest)
        if not self.store.exists(key):
            self.store.put_bytes(key, data)

    def put_bundle_file(self, digest: str, local_path: str) -> None:
        """``put_bundle`` from a local file, streamed (``uploads``)."""
        return None if self.has_bundle(digest) else self.store.put_file(ArtifactStore.bundle_key(digest), local_path)

    def has_bundle(self, digest: str) -> bool:
        return self.store.exists(ArtifactStore.bundle_key(digest))

    def bundle(self, digest: str) -> bytes:
        """The bundle's bytes. Raises NotFound."""
        return self.store.get_bytes(ArtifactStore.bundle_key(digest))

    def artifacts(self, job_id: str) -> list[ArtifactInfo]:
        job_id = self._known(job_id)
        prefix = f"{ArtifactStore.job_prefix(job_id)}/artifacts"
        return [ArtifactInfo(path=p, size=n) for p, n in self.store.list(prefix)]

    def artifact(self, job_id: str, path: str) -> bytes:
        """The bytes of the job's artifact ``path``. Raises NotFound, StorageError (a bad path)."""
        return self.store.get_bytes(self.artifact_key(job_id, path))

    def put_artifact(self, job_id: str, path: str, data: bytes) -> ArtifactInfo:
        """Store ``data`` as the job's artifact ``path`` (replacing it). Raises NotFound, StorageError."""
        self.store.put_bytes(self.artifact_key(job_id, path), data)
        return ArtifactInfo(path=path, size=len(data))

    def checkpoints(self, job_id: str) -> list[ArtifactInfo]:
        """The files of the job's checkpoints, paths relative to its checkpoint folder. Raises NotFound."""
        return [ArtifactInfo(path=p, size=n) for p, n in self.store.list(ArtifactStore.checkpoint_prefix(
            self._known(job_id)))]

    def checkpoint_file(self, job_id: str, path: str) -> bytes:
        """One checkpoint file's bytes. Raises NotFound, StorageError (a path leaving the folder)."""
        return self.store.get_bytes(self.checkpoint_key(job_id, path))

    def checkpoint_key(self, job_id: str, path: str) -> str:
        """Where the job's checkpoint file ``path`` lies. Raises NotFound, InvalidPath."""
        return checkpoint_file_key(self._known(job_id), path)

    def artifact_key(self, job_id: str, path: str) -> str:
        """Where the job's artifact ``path`` is stored. Raises NotFound, InvalidPath (``torchrelay.paths``)."""
        return ArtifactStore.artifact_key(self._known(job_id), path)

    def _known(self, job_id: str) -> str:
        with self.db.read() as rows:
            return rows.job(job_id).id

    # ------------------------------------------------------------ nodes and agents

    def register(self, reg: NodeRegistration) -> RegisterReply:
        """Add a node, or bring a known one (same node_id) back to READY. Idempotent. Blocks up to
        a few seconds on a node whose reach probe does not answer (``reachability``)."""
        problem = problem_of(reg)
        if problem:
            _log.warning("node %s (%s): %s", reg.name, reg.address, problem)
        with self.db.write() as rows:
            node_id = rows.register_node(reg, self.clock(), problem)
        return RegisterReply(node_id=node_id, heartbeat_timeout_s=self.heartbeat_timeout_s)

    def heartbeat(self, node_id: str, hb: Heartbeat) -> HeartbeatReply:
        """Record the node alive, apply the status changes it carries and return its desired
        launches (no waiting): ``heartbeats.beat``. Raises NotFound for an unregistered node."""
        return heartbeats.beat(self.db, self.control, self.store, self.notifier, node_id, hb, self.clock())

    def touch(self, node_id: str) -> None:
        """Record the node as seen now (the end of a long-poll heartbeat)."""
        heartbeats.touch(self.db, node_id, self.clock(), self.heartbeat_timeout_s)

    def desired(self, node_id: str) -> HeartbeatReply:
        """The node's launches as its agent should run them, with the version they are as of.
        Raises NotFound for a node that is not registered."""
        return heartbeats.desired(self.db, self.store, self.notifier, node_id)

    def list_nodes(self) -> list[NodeInfo]:
        with self.db.read() as rows:
            return rows.node_infos()

    def launch_status(self, launch_id: str, status: LaunchStatus) -> None:
        """Record an agent's report on a launch. Idempotent; reports on an exited launch are
        ignored, and so is one that would move the launch back (a resent ``preparing``).
        Raises NotFound for an unknown launch."""
        with self.db.write() as rows:
            held = rows.launches_with_jobs({launch_id})  # (held: see ``Rows.launches_with_jobs``)
            if not held:
                raise NotFound(f"launch {launch_id} is unknown")
            self.control.apply_status(rows, held[0][0], status, self.clock())
