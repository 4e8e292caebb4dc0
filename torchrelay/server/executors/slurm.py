"""The Slurm executor: a partition places the jobs that name it; the server keeps the rest.

Contract:
- ``SlurmExecutor(config, commands=None)``; ``attach(host)`` gives it the service (its
  database, control, store and ingest methods); ``start()`` runs ``step()`` in a daemon thread
  every ``config.file_interval_s`` (sooner on ``kick()``) until ``stop()``. Tests call
  ``step()`` directly.
- One ``step()``: keeps the partition's node READY (seen now) and, every
  ``config.poll_interval_s``, asks Slurm once for every live job (``squeue``; for ids it no
  longer lists, ``sacct`` where accounting is on, else the job-completion log, which is a file
  and not a call): at most two status calls per poll interval, whatever the number of jobs.
  Between polls it reads only files. It places the executor's queued jobs (one ``sbatch
  --parsable`` per attempt, from ``<job_root>/<job>/a<attempt>/``), tails each live launch's
  records and exit record from its node folder and reports them as an agent would, carries
  out what ``slurm_status.decide_attempt`` decides, and stops what the server asked to stop
  (``scancel -s TERM``, then ``scancel`` once the job's ``stop_grace_s`` has passed).
- A parameter-server job is one heterogeneous Slurm job, one component per role
  (``slurm_batch.shape_of``; ``config.hetjob`` False: one step). Its launches are one per
  node, the workers' nodes first.
- When Slurm requeues a job (preemption, ``scontrol requeue``, a node failure) the attempt ends
  as a preemption (not counted) and the next attempt adopts the same Slurm job: no second
  ``sbatch``, so it keeps its place in Slurm's queue. The requeue is noted in the ended
  attempt's folder first (``requeued.json``), so a server restart in between still adopts it;
  the adopted attempt's folder gets its ``launch.json`` and ``slurm.json``, then the name the
  run's batch script waits for (``requeued-<RestartCnt>`` in the folder of the attempt that
  submitted the job). A requeued job whose torchrelay job ends before an attempt adopts it is
  ``scancel``led.
- ``sbatch``'s refusal is the job's failure reason, verbatim. A controller that does not
  answer changes no job: the partition's node goes DRAINING with a note (and back to READY
  with a note when it answers again), and every call is retried at the next poll.
- ``check(spec)`` refuses a job that can never fit the partition (its limits as last read by
  ``sinfo``; a job is accepted while they are unknown). ``dryrun`` renders the batch script.
"""
from __future__ import annotations

import logging
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torchrelay.errors import ExecutorUnavailable, NotFound, StorageError, Unschedulable
from torchrelay.server.assignment import LaunchPlan, launch_assignment, launch_id_of
from torchrelay.server.control import Control
from torchrelay.server.executors import Executor, executor_labels
from torchrelay.server.executors.slurm_batch import (PartitionLimits, SlurmConfig, SlurmShape, Submission,
                                                     parse_sinfo, render_batch_script, shape_of)
from torchrelay.server.executors.slurm_commands import SlurmCommands, SlurmRefused
from torchrelay.server.executors.slurm_folders import (RecordTail, SlurmRun, name_adopted, read_exit, read_requeued,
                                                       read_run, unpack_code, write_launch_plan, write_requeued,
                                                       write_run)
from torchrelay.server.executors.slurm_status import (AttemptView, LaunchFacts, Rule, SlurmJob, decide_attempt,
                                                      parse_jobcomp, parse_sacct, parse_squeue)
from torchrelay.server.rows import Database, Rows, touch_node
from torchrelay.server.scheduling import worker_shape
from torchrelay.server.views import job_id_of
from torchrelay.spec import JobSpec, JobState, NodeState, ParameterServerStrategy
from torchrelay.storage import ArtifactStore
from torchrelay.wire import FailureInfo, LaunchStatus, LogBatch, MetricBatch, NodeRegistration

_log = logging.getLogger("torchrelay.server.slurm")
LIMITS_REFRESH_S = 60.0
HARD_CANCEL_AFTER_S = 10.0  # past the job's stop_grace_s, a job still in Slurm is cancelled outright


class Host(Protocol):
    """What the executor needs of the service."""

    db: Database
    control: Control
    store: ArtifactStore
    clock: Any

    def ingest_logs(self, job_id: str, batch: LogBatch) -> int: ...

    def ingest_metrics(self, job_id: str, batch: MetricBatch) -> int: ...


@dataclass(slots=True)
class _Stopping:
    signalled_at: float
    hard: bool = False


@dataclass(slots=True)
class _Poll:
    """What the last status call said, by Slurm job id."""

    jobs: dict[str, SlurmJob] = field(default_factory=dict)
    missing: dict[str, int] = field(default_factory=dict)
    unreachable: str | None = None
    at: float = float("-inf")


class SlurmExecutor(Executor):
    """See the module docstring."""

    def __init__(self, config: SlurmConfig, commands: SlurmCommands | None = None):
        self.name = config.name
        self.config = config
        self.commands = commands or SlurmCommands()
        self.node_id = f"slurm-{config.name}"
        self.limits: PartitionLimits | None = None
        self._limits_at = float("-inf")
        self._host: Host | None = None
        self._poll = _Poll()
        self._tails: dict[str, RecordTail] = {}
        self._stopping: dict[str, _Stopping] = {}
        self._fresh: set[tuple[int, int]] = set()  # attempts placed by this process, not yet sbatch'ed
        self._runs: dict[tuple[str, int], SlurmRun] = {}  # (job, attempt): which run of its Slurm job it is
        self._unadopted: dict[str, str] = {}  # job -> its Slurm job requeued, not adopted yet
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step_lock = threading.Lock()
        self.polls = 0  # status polls done (the benchmark divides calls by these)

    # ------------------------------------------------------------ Executor

    def attach(self, host: Host) -> None:
        self._host = host

    def check(self, spec: JobSpec) -> None:
        if self.limits is not None:
            shape_of(spec, self.limits, hetjob=self.config.hetjob)

    def dryrun(self, spec: JobSpec, job_id: str) -> str:
        return render_batch_script(self._submission(job_id, 1, self._shape(spec)))

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"relay-{self.name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def kick(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # the loop must outlive one bad step; the error is logged
                _log.exception("slurm executor %s: step failed", self.name)
            self._wake.wait(self.config.file_interval_s)
            self._wake.clear()

    # ------------------------------------------------------------ one step

    def step(self, *, poll: bool | None = None) -> None:
        """One pass (see the module docstring); ``poll``: force (True) or skip (False) the status call."""
        with self._step_lock:
            host = self._need_host()
            now = time.monotonic()
            due = poll or (poll is None and now - self._poll.at >= self.config.poll_interval_s)
            if self.limits is None and due:  # at start, and until sinfo first answers
                self._poll.at, due = now, False
                try:
                    self._refresh_limits(now)
                except ExecutorUnavailable as exc:
                    _log.warning("slurm executor %s: cannot read the partition's limits: %s", self.name, exc)
            self._keep_node(host)
            self._place_queued(host)
            self._drop_unadopted(host)
            live = self._live(host)
            for (seq, attempt), launches in live.items():
                if launches[0].external_id is None and self._poll.unreachable is None:
                    self._submit(host, seq, attempt, launches)
            if due:
                self._status_poll(host, live, now)
            self._follow(host, live)
            self._stop_requested(host, live, now)

    def _need_host(self) -> Host:
        if self._host is None:
            raise RuntimeError(f"slurm executor {self.name} is not attached to a service")
        return self._host

    def _refresh_limits(self, now: float) -> None:
        """The partition's limits from ``sinfo``. Raises ``ExecutorUnavailable``."""
        self._limits_at = now
        limits = parse_sinfo(self.commands.sinfo(self.config.partition), self.config.partition)
        if not limits.nodes:
            _log.warning("slurm executor %s: partition %r has no nodes (or does not exist)", self.name,
                         self.config.partition)
        self.limits = limits

    def _keep_node(self, host: Host) -> None:
        """The partition's node exists with its capacity (it has no heartbeat: the lost-node
        watchdog leaves it alone, and Slurm's own state says what happened to its jobs)."""
        with host.db.read() as rows:
            node = rows.node(self.node_id)
            current = node is not None and not self._node_changed(node)
        if not current:
            with host.db.write() as rows:
                rows.register_node(self._registration(), host.clock())

    def _node_changed(self, node: Any) -> bool:
        reg = self._registration()
        return (node.cpus, node.gpus, node.memory) != (reg.cpus, reg.gpus, reg.memory)

    def _registration(self) -> NodeRegistration:
        nodes = self.limits.nodes if self.limits is not None else ()
        return NodeRegistration(node_id=self.node_id, name=f"{self.name}:{self.config.partition}", address="",
                                cpus=float(sum(n.cpus for n in nodes)), gpus=sum(n.gpus for n in nodes),
                                memory=sum(n.memory_mb for n in nodes) * 1024 * 1024,
                                labels=dict(executor_labels(self.name)))

    # ------------------------------------------------------------ placing

    def _place_queued(self, host: Host) -> None:
        """Each of the executor's waiting jobs gets its next attempt's launches (one per node),
        submitted by ``_submit``; one that can never fit fails. Looked for without the writer
        lock: most steps find none."""
        with host.db.read() as rows:
            waiting = [brief.seq for brief in rows.scheduled_jobs() if self._waiting(rows, brief)]
        if not waiting:
            return
        with host.db.write() as rows:
            now = host.clock()
            for brief in rows.scheduled_jobs():
                if brief.seq not in waiting or not self._waiting(rows, brief):  # (read again, under the lock)
                    continue
                row, spec = rows.job_by_seq(brief.seq), rows.facts(brief.seq).spec
                try:
                    shape = self._shape(spec)
                except Unschedulable as exc:
                    _fail(rows, row, str(exc), now)
                    continue
                attempt = host.control.begin_attempt(row)
                self._fresh.add((row.seq, attempt))
                host.control.record_placement(rows, row, self._plans(row.id, attempt, spec, shape),
                                              f"submitting to Slurm partition {self.config.partition!r} "
                                              f"({shape.describe()})", now)

    def _waiting(self, rows: Rows, brief: Any) -> bool:
        """Whether the job is this executor's and waits for its next attempt."""
        if brief.state not in (JobState.QUEUED.value, JobState.RESTARTING.value):
            return False
        if rows.facts(brief.seq).spec.executor != self.name:
            return False
        return not (brief.attempt and rows.live_launches(rows.job_by_seq(brief.seq)))

    def _shape(self, spec: JobSpec) -> SlurmShape:
        """The job's shape on the partition (while its limits are unknown: the spec's nodes, else one)."""
        return shape_of(spec, self.limits, hetjob=self.config.hetjob)

    def _plans(self, job_id: str, attempt: int, spec: JobSpec, shape: SlurmShape) -> tuple[LaunchPlan, ...]:
        """One launch per node, group after group (workers, then servers): ranks follow node ranks."""
        plans, node_rank, rank = [], 0, 0
        for group in shape.groups:
            servers = group.role == "servers" and isinstance(spec.strategy, ParameterServerStrategy)
            granted = worker_shape(spec.strategy.server_resources if servers else spec.resources)
            for _ in range(group.nodes):
                plans.append(LaunchPlan(id=launch_id_of(job_id, attempt, node_rank), node_id=self.node_id,
                                        node_rank=node_rank, nnodes=shape.nodes, nproc=group.per_node,
                                        rank_offset=rank, world_size=shape.world, shape=granted))
                node_rank, rank = node_rank + 1, rank + group.per_node
        return tuple(plans)

    def _submission(self, job_id: str, attempt: int, shape: SlurmShape) -> Submission:
        return Submission(name=self.config.slurm_name(job_id, attempt), config=self.config, shape=shape,
                          attempt_dir=self.config.attempt_dir(job_id, attempt))

    def _submit(self, host: Host, seq: int, attempt: int, launches: list[Any]) -> None:
        """Write the attempt's folder and ``sbatch`` it; record the Slurm id, or fail the job
        with sbatch's words. A controller that does not answer leaves it to a later step; an
        attempt told to stop before it was submitted just ends. An attempt that follows one
        Slurm's requeue ended adopts that Slurm job (``_adopt``): no ``sbatch``. An attempt this
        process did not just place (its ``sbatch`` may have run without its answer arriving: a
        timeout, a server restart) is first looked for in Slurm's queue by its job name, so it is
        never submitted twice."""
        job_id = _job_id(launches[0])
        fresh = (seq, attempt) in self._fresh
        self._fresh.discard((seq, attempt))
        if launches[0].desired == "stop":
            self._end_unsubmitted(host, seq, attempt)
            return
        with host.db.read() as rows:
            shape = self._shape(rows.facts(seq).spec)
        attempt_dir = Path(self.config.attempt_dir(job_id, attempt))
        requeued = read_requeued(Path(self.config.attempt_dir(job_id, attempt - 1))) if attempt > 1 else None
        try:
            if requeued is not None:
                self._adopt(host, job_id, attempt, shape, *requeued)
                return
            found = [] if fresh else self.commands.job_ids_named(self.config.slurm_name(job_id, attempt))
            if found:
                self._record_submitted(host, job_id, attempt, found[0], "found in Slurm's queue, not submitted again")
                return
            self._write_attempt(host, job_id, attempt, attempt_dir, shape)
            script = attempt_dir / "job.sbatch"
            script.write_text(render_batch_script(self._submission(job_id, attempt, shape)))
            slurm_id = self.commands.sbatch(script, attempt_dir)
        except (SlurmRefused, OSError, StorageError, tarfile.TarError, Unschedulable) as exc:
            with host.db.write() as rows:
                how = "adopting the requeued Slurm job failed" if requeued is not None else "sbatch failed"
                _fail(rows, rows.job_by_seq(seq), f"{how}: {exc}", host.clock(), attempt=attempt)
            if requeued is not None:
                self._scancel([requeued[0]])
            return
        except ExecutorUnavailable as exc:
            self._controller_down(host, str(exc))
            return
        self._record_submitted(host, job_id, attempt, slurm_id, "submitted")

    def _adopt(self, host: Host, job_id: str, attempt: int, shape: SlurmShape, slurm_id: str, restart: int) -> None:
        """Attempt ``attempt`` is the run of Slurm job ``slurm_id`` after its ``restart``-th
        requeue: its folder (``launch.json``, then ``slurm.json``), then the name the run's batch
        script waits for in the folder of the attempt that submitted the job. Raises ``OSError``
        and the like (``_submit`` fails the job)."""
        previous = Path(self.config.attempt_dir(job_id, attempt - 1))
        base = self._run_of(job_id, attempt - 1, slurm_id, previous).base
        attempt_dir = Path(self.config.attempt_dir(job_id, attempt))
        self._write_attempt(host, job_id, attempt, attempt_dir, shape)
        run = SlurmRun(slurm_id, base, restart)
        write_run(attempt_dir, run)
        name_adopted(base, restart, attempt_dir)
        self._unadopted.pop(job_id, None)
        self._record_submitted(host, job_id, attempt, slurm_id, f"requeued by Slurm (its restart {restart}) is "
                               f"adopted as attempt {attempt}: no new sbatch, its place in Slurm's queue kept")

    def _run_of(self, job_id: str, attempt: int, slurm_id: str, attempt_dir: Path) -> SlurmRun:
        """Which run of its Slurm job the attempt is (read once: ``slurm.json``; none: the
        attempt submitted the job itself)."""
        key = (job_id, attempt)
        run = self._runs.get(key)
        if run is None or run.slurm_id != slurm_id:
            run = read_run(attempt_dir)
            if run is None or run.slurm_id != slurm_id:
                run = SlurmRun(slurm_id, str(attempt_dir), 0)
            self._runs[key] = run
        return run

    def _record_submitted(self, host: Host, job_id: str, attempt: int, slurm_id: str, how: str) -> None:
        with host.db.write() as rows:
            row = rows.job(job_id)
            for launch in rows.attempt_launches(row.seq, attempt):
                launch.external_id = slurm_id
            rows.add_event(row, f"Slurm job {slurm_id} {how}", host.clock())
        self.kick()

    def _write_attempt(self, host: Host, job_id: str, attempt: int, attempt_dir: Path, shape: SlurmShape) -> None:
        """The job's code (once) and the attempt's ``launch.json`` on the shared file system:
        node 0's assignment and each group's shape and worker environment."""
        code_dir = Path(self.config.code_dir(job_id))
        with host.db.read() as rows:
            row = rows.job(job_id)
            facts = rows.facts(row.seq)
            launches = rows.attempt_launches(row.seq, attempt)
            bundle = row.bundle
        if not code_dir.exists():
            unpack_code(code_dir, host.store.get_bytes(ArtifactStore.bundle_key(bundle)) if bundle else None)
        launches = sorted(launches, key=lambda x: x.node_rank)
        head = launches[0]
        assignment = launch_assignment(
            _Assigned(head, bundle), job_id=job_id, argv=facts.argv(), env=facts.worker_env(head.gpu, None),
            spec_stop_grace_s=facts.spec.stop_grace_s, master=(None, None), store_url=host.store.url)
        groups, first = [], 0
        for group in shape.groups:
            gpu = launches[first].gpu if first < len(launches) else head.gpu
            groups.append({"role": group.role, "nodes": group.nodes, "per_node": group.per_node,
                           "env": facts.worker_env(gpu, None)})
            first += group.nodes
        write_launch_plan(attempt_dir, assignment, [x.id for x in launches], code_dir, groups)

    @staticmethod
    def _end_unsubmitted(host: Host, seq: int, attempt: int) -> None:
        with host.db.write() as rows:
            for launch in rows.attempt_launches(seq, attempt):
                if launch.state != "exited":
                    host.control.launch_exited(rows, launch, LaunchStatus(
                        state="exited", succeeded=False, stopped=True, message="stopped before it was submitted"),
                        host.clock())

    # ------------------------------------------------------------ status

    def _live(self, host: Host) -> dict[tuple[int, int], list[Any]]:
        """The executor's launches that have not exited, by (job seq, attempt)."""
        out: dict[tuple[int, int], list[Any]] = {}
        with host.db.read() as rows:
            for launch in sorted(rows.live_on_node_orm(self.node_id), key=lambda x: (x.job_seq, x.node_rank)):
                out.setdefault((launch.job_seq, launch.attempt), []).append(launch)
        return out

    def _status_poll(self, host: Host, live: dict[tuple[int, int], list[Any]], now: float) -> None:
        """At most two Slurm calls: one ``squeue`` for every live job; for those it no longer
        lists one ``sacct`` (or the job-completion log, a file); else, once a minute or while
        the controller is down with no job to ask about, one ``sinfo`` (the partition's limits,
        and whether the controller answers)."""
        ids = sorted({x.external_id for group in live.values() for x in group if x.external_id}, key=_numeric)
        self._poll.at = now
        stale = now - self._limits_at >= LIMITS_REFRESH_S
        if not ids and not stale and self._poll.unreachable is None:
            return
        self.polls += 1
        calls, jobs = 0, {}
        try:
            if ids:
                jobs, calls = parse_squeue(self.commands.squeue(ids)), 1
                gone = [i for i in ids if i not in jobs]
                if gone:
                    calls += self.config.accounting
                    jobs.update(self._finished(gone))
            if calls < 2 and (stale or not ids):
                self._refresh_limits(now)
        except ExecutorUnavailable as exc:
            self._controller_down(host, str(exc))
            return
        self._controller_up(host)
        with host.db.write() as rows:  # the node's "seen": when Slurm last answered
            touch_node(rows.conn, self.node_id, host.clock(), unless_seen_after=host.clock() - 1.0)
        if ids:
            self._poll.jobs = jobs
            self._poll.missing = {i: (0 if i in jobs else self._poll.missing.get(i, 0) + 1) for i in ids}

    def _finished(self, ids: list[str]) -> dict[str, SlurmJob]:
        if self.config.accounting:
            return parse_sacct(self.commands.sacct(ids))
        if self.config.jobcomp_path:
            try:
                return parse_jobcomp(Path(self.config.jobcomp_path).read_text(errors="replace"), set(ids))
            except OSError as exc:
                _log.warning("slurm executor %s: cannot read the job-completion log: %s", self.name, exc)
        return {}

    def _controller_down(self, host: Host, message: str) -> None:
        if self._poll.unreachable is not None:
            return
        self._poll.unreachable = message
        _log.warning("slurm executor %s: %s; jobs keep their state, retrying every %g s", self.name, message,
                     self.config.poll_interval_s)
        self._set_node(host, NodeState.DRAINING, f"Slurm unreachable since {time.strftime('%H:%M:%S')}: "
                       f"{message}; jobs keep their last known state, retried every "
                       f"{self.config.poll_interval_s:g} s")

    def _controller_up(self, host: Host) -> None:
        if self._poll.unreachable is None:
            return
        self._poll.unreachable = None
        self._set_node(host, NodeState.READY, f"Slurm answers again since {time.strftime('%H:%M:%S')}")

    def _set_node(self, host: Host, state: NodeState, note: str) -> None:
        with host.db.write() as rows:
            node = rows.node(self.node_id)
            if node is not None:
                rows.set_node_state(node, state)
                node.note = note

    # ------------------------------------------------------------ following launches

    def _follow(self, host: Host, live: dict[tuple[int, int], list[Any]]) -> None:
        """Each live attempt: records and exit records from its folder, then ``decide_attempt``."""
        live_launches = {x.id for launches in live.values() for x in launches}
        for launch_id in [x for x in self._tails if x not in live_launches]:  # exited: its file is read
            del self._tails[launch_id]
        live_attempts = {(_job_id(launches[0]), attempt) for (_, attempt), launches in live.items()}
        for key in [x for x in self._runs if x not in live_attempts]:
            del self._runs[key]
        for (seq, attempt), launches in live.items():
            slurm_id = launches[0].external_id
            if slurm_id is None:
                continue  # not submitted yet
            job_id = _job_id(launches[0])
            attempt_dir = Path(self.config.attempt_dir(job_id, attempt))
            run = self._run_of(job_id, attempt, slurm_id, attempt_dir)
            records = {x.node_rank: read_exit(attempt_dir / f"node-{x.node_rank}" / "exit.json") for x in launches}
            for launch in launches:  # after the exit records: a launch's last lines precede its end
                self._ship(host, job_id, launch, attempt_dir / f"node-{launch.node_rank}" / "records.jsonl")
            view = AttemptView(
                slurm=self._poll.jobs.get(slurm_id), unreachable=self._poll.unreachable is not None,
                missing_polls=self._poll.missing.get(slurm_id, 0), restarts=run.restart,
                launches=tuple(LaunchFacts(node_rank=x.node_rank, state=x.state, desired=x.desired,
                                           record=records[x.node_rank],
                                           started=(attempt_dir / f"node-{x.node_rank}").is_dir())
                               for x in launches))
            decision = decide_attempt(view)
            if decision.adopt and view.slurm is not None and not self._note_requeued(job_id, attempt_dir, view.slurm):
                continue  # the note could not be written: the next step decides again
            if decision.reports or decision.rule is not None:
                self._apply(host, seq, attempt, decision)
            if decision.scancel:
                self._scancel([slurm_id])

    def _note_requeued(self, job_id: str, attempt_dir: Path, slurm: SlurmJob) -> bool:
        """Slurm requeued the attempt's job and holds it: the next attempt adopts it (noted in
        the attempt's folder first, so that a server restart in between still adopts it)."""
        try:
            write_requeued(attempt_dir, slurm.job_id, slurm.restarts)
        except OSError as exc:
            _log.warning("slurm executor %s: cannot note the requeue of Slurm job %s: %s", self.name,
                         slurm.job_id, exc)
            return False
        self._unadopted[job_id] = slurm.job_id
        return True

    def _drop_unadopted(self, host: Host) -> None:
        """A requeued Slurm job whose torchrelay job ended (cancelled) before an attempt adopted
        it is cancelled: nothing is left in Slurm's queue."""
        if not self._unadopted:
            return
        with host.db.read() as rows:
            ended = [job_id for job_id in self._unadopted if _ended(rows, job_id)]
        for job_id in ended:
            self._scancel([self._unadopted.pop(job_id)])

    def _ship(self, host: Host, job_id: str, launch: Any, path: Path) -> None:
        logs, metrics = self._tails.setdefault(launch.id, RecordTail()).read(path)
        if logs:
            host.ingest_logs(job_id, LogBatch(launch_id=launch.id, records=logs))
        if metrics:
            host.ingest_metrics(job_id, MetricBatch(launch_id=launch.id, records=metrics))

    def _apply(self, host: Host, seq: int, attempt: int, decision: Any) -> None:
        """Carry out an ``AttemptDecision`` in one transaction."""
        with host.db.write() as rows:
            row, now = rows.job_by_seq(seq), host.clock()
            if row.attempt != attempt:
                return
            launches = {x.node_rank: x for x in rows.attempt_launches(seq, attempt)}
            if decision.rule == Rule.CANCELLED and JobState(row.state) != JobState.CANCELLING:
                host.control.cancel(rows, row, checkpoint=False, now=now)
                rows.add_event(row, decision.reason, now)
            elif decision.rule == Rule.REQUEUE:
                row.requeue = True
                rows.add_event(row, decision.reason, now)
            elif decision.rule == Rule.FAIL:
                for launch in launches.values():
                    launch.stop_kind, launch.stop_reason = "runtime", decision.reason
            for node_rank, status, infra in decision.reports:
                launch = launches[node_rank]
                if launch.state == "exited":
                    continue
                if status.state == "exited":
                    host.control.launch_exited(rows, launch, status, now, infra=infra)
                else:
                    host.control.apply_status(rows, launch, status, now)

    # ------------------------------------------------------------ stopping

    def _stop_requested(self, host: Host, live: dict[tuple[int, int], list[Any]], now: float) -> None:
        """Launches the server wants stopped: ``scancel -s TERM`` (the steps stop their workers
        with the job's grace), then ``scancel`` once the grace has passed; a job that has not
        started yet, or one stopped with no grace, is cancelled at once. One call per kind."""
        gentle, hard = [], []
        with host.db.read() as rows:
            for (seq, _attempt), launches in live.items():
                head = launches[0]
                if head.desired != "stop" or not head.external_id:
                    continue
                grace = head.stop_grace_s if head.stop_grace_s is not None else rows.facts(seq).spec.stop_grace_s
                slurm = self._poll.jobs.get(head.external_id)
                stopping = self._stopping.get(head.external_id)
                started = slurm is not None and slurm.running or any(x.state == "running" for x in launches)
                if stopping is None and grace > 0 and started:
                    gentle.append(head.external_id)
                elif (stopping is None or not stopping.hard) and (
                        stopping is None or now - stopping.signalled_at > grace + HARD_CANCEL_AFTER_S):
                    hard.append(head.external_id)
        live_ids = {launches[0].external_id for launches in live.values()}
        for slurm_id in [x for x in self._stopping if x not in live_ids]:  # ended: forget it
            del self._stopping[slurm_id]
        for slurm_id in gentle:
            self._stopping[slurm_id] = _Stopping(signalled_at=now)
        for slurm_id in hard:
            self._stopping[slurm_id] = _Stopping(signalled_at=now, hard=True)
        self._scancel(gentle, signal="TERM")
        self._scancel(hard)

    def _scancel(self, ids: list[str], signal: str | None = None) -> None:
        if not ids:
            return
        try:
            self.commands.scancel(ids, signal=signal)
        except ExecutorUnavailable as exc:
            for slurm_id in ids:  # tried again at the next step
                self._stopping.pop(slurm_id, None)
            _log.warning("slurm executor %s: scancel %s failed: %s", self.name, ",".join(ids), exc)


@dataclass(frozen=True, slots=True)
class _Assigned:
    """A launch row with its job's bundle: what ``launch_assignment`` reads."""

    row: Any
    bundle: str | None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.row, name)


def _fail(rows: Rows, row: Any, reason: str, now: float, attempt: int | None = None) -> None:
    """End the job FAILED with ``reason`` (``attempt``'s launches exited with it)."""
    for launch in rows.attempt_launches(row.seq, attempt) if attempt else []:
        if launch.state != "exited":
            rows.record_exit(launch, LaunchStatus(state="exited", succeeded=False, message=reason), stopped=False,
                             infra=False)
    row.failure = FailureInfo(reason=reason, attempt=row.attempt).model_dump()
    rows.set_state(row, JobState.FAILED, reason, now)


def _ended(rows: Rows, job_id: str) -> bool:
    try:
        return JobState(rows.job(job_id).state).terminal
    except NotFound:
        return True


def _job_id(launch: Any) -> str:
    return job_id_of(launch.job_seq)


def _numeric(slurm_id: str) -> tuple[int, str]:
    return (int(slurm_id), "") if slurm_id.isdigit() else (0, slurm_id)

