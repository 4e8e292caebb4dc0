"""The control loop: read views, ask the decision modules, carry out their decisions.

``Control.tick()`` is the loop's one step (tests call it directly), one transaction: at most
every ``check_interval_s`` the watchdogs (lost nodes, hung jobs, runtime overruns), then one
scheduling cycle that places queued jobs, preempts, shrinks elastic jobs (their chosen ranks
told to leave, an event saying why), grows them back (joiners' launches added to the running
attempt) and records why the others wait.
``run()`` steps it in a background thread whenever something changes (``kick``), and at least
every ``tick_s``. The other methods carry out what requests cause (a launch's status, a
cancel) inside the caller's unit of work (``rows.Database.write``); each takes the server time
``now``. The decisions themselves are made by ``lifecycle``, ``failures``, ``watchdogs`` and the
scheduling policy; this module only applies them, and notifies through the unit's outbox.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from torchrelay import scheduler as policy
from torchrelay.errors import StaleAttempt, StorageError
from torchrelay.server import lifecycle, scheduling, watchdogs
from torchrelay.server.assignment import grow_launches, mpi_world, placed_layout, plan_launches, ranks_to_release
from torchrelay.server.executors import agents_only, is_agents_job
from torchrelay.server.quotas import QuotaTable
from torchrelay.server.rows import Database, JobBrief, JobFacts, Rows
from torchrelay.spec import JobState, LaunchState, NodeState
from torchrelay.storage import ArtifactStore
from torchrelay.wire import LaunchStatus

_log = logging.getLogger("torchrelay.server")
Waiting = tuple[JobBrief, JobFacts]  # a waiting job's row and facts


class Control:
    """Applies decisions to one ``Database``; see the module docstring."""

    def __init__(self, db: Database, store: ArtifactStore, *, quotas: QuotaTable, heartbeat_timeout_s: float,
                 tick_s: float, clock: Callable[[], float]):
        self.db, self.store, self.quotas, self.clock = db, store, quotas, clock
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.tick_s = tick_s
        self.min_tick_interval_s = 0.02  # a burst of submits shares one scheduling cycle
        self.check_interval_s = min(0.25, tick_s / 2)
        self._last_checks = float("-inf")
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # called with each background cycle's duration in seconds (the /metrics histogram)
        self.on_cycle: Callable[[float], None] | None = None

    # ------------------------------------------------------------ the loop

    def tick(self) -> None:
        """One control-loop step. Idempotent."""
        with self.db.write() as rows:
            now = self.clock()
            if watchdogs.checks_due(now, self._last_checks, self.check_interval_s):
                self._last_checks = now
                self.watch(rows, now)
            self.schedule(rows, now)

    def kick(self) -> None:
        """Ask for a step soon. Does not block; any thread."""
        self._wake.set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Run ``tick`` in a daemon thread until ``stop``. Idempotent."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="relay-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:  # the loop must survive a bad row; the error is logged
                _log.exception("scheduler tick failed")
            if self.on_cycle is not None:
                self.on_cycle(time.monotonic() - started)
            # a long queue makes a cycle cost more: space cycles so that they hold the lock at
            # most about a third of the time and requests (submits, heartbeats) get through
            self._stop.wait(max(self.min_tick_interval_s, 2 * (time.monotonic() - started)))
            self._wake.wait(self.tick_s)
            self._wake.clear()

    # ------------------------------------------------------------ watchdogs

    def watch(self, rows: Rows, now: float) -> None:
        """Lost nodes, then hung jobs, then runtime overruns, each read after the one before acted."""
        views = rows.nodes().views
        heartbeating = {n.id for n in agents_only(views)}  # an executor's node has no heartbeat to miss
        for lost in watchdogs.lost_nodes([x for x in rows.liveness() if x.id in heartbeating], now=now,
                                         timeout_s=self.heartbeat_timeout_s):
            node = rows.node(lost.node_id)
            rows.set_node_state(node, NodeState.LOST, now)
            for launch in rows.live_on_node_orm(node.id):
                self.launch_exited(rows, launch, LaunchStatus(state="exited", succeeded=False, message=lost.message),
                                   now, infra=True)
        for hang in watchdogs.hung_jobs(rows.progress_views(), now=now):
            row = rows.job_by_seq(hang.seq)
            row.last_progress_at = None
            rows.stop_launches(row, hang.stop)
            rows.add_event(row, hang.event, now)
            row.failure = hang.failure.model_dump()
            row.hung_attempt = row.attempt  # its failure, not the ranks' exits, explains the attempt
        for seq, stop in watchdogs.overruns(rows.runtime_views(), now=now):
            row = rows.job_by_seq(seq)
            rows.stop_launches(row, stop)
            rows.add_event(row, f"stopping: {stop.reason}", now)

    # ------------------------------------------------------------ launches and jobs

    def apply_status(self, rows: Rows, launch: Any, status: LaunchStatus, now: float) -> None:
        """An agent's report on ``launch``: reports on an exited launch, and ones that would move
        it back (a resent ``preparing``), change nothing."""
        if launch.state == LaunchState.EXITED.value:
            return
        if status.master_port and launch.master_port != status.master_port:
            rows.set_master_port(launch, status.master_port)
        if status.mpi_daemons:
            rows.set_mpi_daemons(launch, status.mpi_daemons)
        target = lifecycle.launch_update(LaunchState(launch.state), LaunchState(status.state))
        if target == LaunchState.EXITED:
            self.launch_exited(rows, launch, status, now)
        elif target is not None:
            rows.advance_launch(launch, target)
            if status.message and target == LaunchState.RUNNING:  # how it started (warm, or why not)
                rows.add_event(rows.job_by_seq(launch.job_seq), f"launch {launch.id}: {status.message}", now)
            self.evaluate(rows, rows.job_by_seq(launch.job_seq), now, _alone(launch))

    def launch_exited(self, rows: Rows, launch: Any, status: LaunchStatus, now: float, infra: bool = False) -> None:
        """Record the launch's exit (``infra``: for a reason outside the job) and move its job on."""
        stopped = lifecycle.stopped_by_server(reported_stopped=status.stopped, desired=launch.desired,
                                              succeeded=bool(status.succeeded))
        rows.record_exit(launch, status, stopped=stopped, infra=infra)
        self.evaluate(rows, rows.job_by_seq(launch.job_seq), now, _alone(launch))

    def evaluate(self, rows: Rows, row: Any, now: float, launches: list | None = None) -> None:
        """Move the job on from what its current attempt's launches report (``launches``: they,
        when the caller holds them all). Idempotent."""
        state = JobState(row.state)
        if state.terminal or state == JobState.QUEUED:
            return
        if launches is None or any(x.attempt != row.attempt for x in launches):  # (a replaced attempt's)
            launches = rows.attempt_launches(row.seq, row.attempt)
        if not launches:
            return
        decision = lifecycle.decide(rows.job_view(row), rows.launch_views(launches))
        if decision is not lifecycle.NOTHING:
            self.apply(rows, row, decision, now)

    @staticmethod
    def apply(rows: Rows, row: Any, decision: lifecycle.JobDecision, now: float) -> None:
        """Carry out a ``JobDecision`` in the order its contract gives."""
        if decision.failure is not None:
            row.failure = decision.failure.model_dump()
        elif decision.clears_failure:
            row.failure = None
        if decision.requeued:
            row.requeue = False
        if decision.restart is not None:
            if decision.restart.counted:
                row.restarts += 1
            row.restart_reasons = [*(row.restart_reasons or []), decision.restart.failure.model_dump()]
        if decision.stop is not None:
            rows.stop_launches(row, decision.stop)
        for step in decision.transitions:
            rows.set_state(row, step.state, step.message, now)

    def cancel(self, rows: Rows, row: Any, checkpoint: bool, now: float) -> None:
        state = JobState(row.state)
        live = rows.live_launches(row) if state.active else []
        decision = lifecycle.cancel(state, has_live_launches=bool(live), checkpoint=checkpoint)
        for step in decision.transitions:
            rows.set_state(row, step.state, step.message, now)
        if decision.stop is not None:
            rows.stop_launches(row, decision.stop, no_grace=decision.kill_at_once)
            self.evaluate(rows, row, now)

    # ------------------------------------------------------------ scheduling

    def scheduler_input(self, rows: Rows, now: float) -> tuple[policy.SchedulerInput, dict[str, Waiting]]:
        """What the policy sees now: nodes, jobs holding resources, the queue (with each waiting
        job's row and facts, by id) and the quotas of the users in it. Plain columns and cached
        facts, so a cycle over a long queue costs little beyond the policy itself."""
        live_by_job = rows.live_by_job()
        running, queue, waiting = [], [], {}
        for brief in rows.scheduled_jobs():
            facts = rows.facts(brief.seq)
            if not is_agents_job(facts.spec):  # another executor places it (torchrelay.server.executors)
                continue
            live = [x for x in live_by_job.get(brief.seq, ()) if x.attempt == brief.attempt] if brief.attempt else []
            if live:
                running.append(scheduling.allocation(
                    seq=brief.seq, spec=facts.spec, live=live,
                    started_at=brief.placed_at if brief.placed_at is not None else brief.submitted_at,
                    preempting=bool(brief.requeue) or brief.state == JobState.CANCELLING.value,
                    running=brief.state == JobState.RUNNING.value and scheduling.all_running(live)))
            elif brief.state in (JobState.QUEUED.value, JobState.RESTARTING.value):
                queue.append(facts.queued)
                waiting[facts.queued.job_id] = (brief, facts)
        quotas = self.quotas.for_users([a.user for a in running] + [q.user for q in queue])
        inp = policy.SchedulerInput(nodes=agents_only(rows.nodes().views), running=tuple(running),
                                    queue=tuple(queue), now=now, quotas=quotas)
        return inp, waiting

    def schedule(self, rows: Rows, now: float) -> None:
        """One scheduling cycle, its decisions carried out."""
        inp, waiting = self.scheduler_input(rows, now)
        if not inp.queue and not policy.growable(inp.running):
            return
        # start estimates are for `relay queue` only: a tick does not pay for them
        decisions = policy.schedule(dataclasses.replace(inp, estimate_limit=0))
        # their rows in few queries; held, as the session keeps only objects referenced elsewhere
        loaded = rows.load_jobs([waiting[p.job_id][0].seq for p in decisions.placements])
        for placement in decisions.placements:
            brief, facts = waiting[placement.job_id]
            self.place(rows, rows.job_by_seq(brief.seq), facts, placement, now)
        for victim in decisions.preemptions:
            vrow = rows.job(victim)
            stop = lifecycle.preemption(JobState(vrow.state))
            if stop is not None:
                vrow.requeue = True
                rows.stop_launches(vrow, stop)
        for shrink in decisions.shrinks:
            self.shrink(rows, shrink, now)
        for grow in decisions.grows:
            self.grow(rows, grow, now)
        reasons = ((waiting[job_id], scheduling.waiting_reason(reason, waiting[job_id][1].spec))
                   for job_id, reason in decisions.waiting.items() if job_id in waiting)
        rows.set_waiting_reasons((brief.seq, reason) for (brief, _), reason in reasons
                                 if brief.waiting_reason != reason)
        del loaded

    @staticmethod
    def shrink(rows: Rows, shrink: policy.Shrink, now: float) -> None:
        """Carry out a ``Shrink``: on each node it names, the job's highest ranks there not
        released yet are told to leave (their agent SIGTERMs those ranks only; the elastic
        group goes on without them); an event says which and for whom. Nothing for a job that
        is no longer running (it ended, or is being stopped anyway)."""
        row = rows.job(shrink.job_id)
        if JobState(row.state) != JobState.RUNNING or row.requeue:
            return
        launches = rows.live_launches(row)
        before = sum(scheduling.held_workers(x) for x in launches)
        ranks: list[int] = []
        for node_id, count in shrink.release:
            # a node may hold several launches of a grown job: the last one's ranks go first
            for launch in reversed([x for x in launches if x.node_id == node_id and x.desired == "run"]):
                take = min(count, scheduling.held_workers(launch))
                if take <= 0:
                    continue
                chosen = ranks_to_release(rank_offset=launch.rank_offset, nproc=launch.nproc,
                                          released=launch.released, count=take)
                rows.release_ranks(launch, chosen)
                ranks += chosen
                count -= take
        if ranks:
            rows.add_event(row, scheduling.shrink_event(shrink, ranks, before, rows.nodes().names), now)

    @staticmethod
    def grow(rows: Rows, grow: policy.Grow, now: float) -> None:
        """Carry out a ``Grow``: the new workers' launches join the job's current attempt
        (``grow_launches``; their agents start them as joiners, which the members admit at a step
        boundary), and an event says which ranks join. Nothing for a job that is no longer
        running, whose node 0 (the store the joiners meet in) has exited, or some of whose
        workers finished (``scheduling.workers_finished``)."""
        row = rows.job(grow.job_id)
        if JobState(row.state) != JobState.RUNNING or row.requeue:
            return
        launches = rows.attempt_launches(row.seq, row.attempt)
        live = [x for x in launches if x.state != LaunchState.EXITED.value]
        if not live or launches[0].node_rank != 0 or launches[0] not in live or scheduling.workers_finished(launches):
            return
        plans = grow_launches(row.id, row.attempt, launches, grow.add, grow.shape)
        before = sum(scheduling.held_workers(x) for x in live)
        rows.add_launches(row, plans)
        ranks = [r for plan in plans for r in range(plan.rank_offset, plan.rank_offset + plan.nproc)]
        rows.add_event(row, scheduling.grow_event(grow, ranks, before, rows.nodes().names), now)

    def place(self, rows: Rows, row: Any, facts: JobFacts, placement: policy.Placement, now: float) -> None:
        """Start the job's next attempt where the policy placed it: one launch per role and node
        (an elastic job placed with fewer workers than it asks: a world of those placed)."""
        attempt = self.begin_attempt(row)
        nodes = rows.nodes()
        where = scheduling.placement_summary(placement, facts.spec, nodes.names, nodes.gpu_types)
        layout = placed_layout(facts.environment.layout, placement, scheduling.elastic_min(facts.spec))
        plans = plan_launches(row.id, attempt, placement, layout)
        self.record_placement(rows, row, plans, f"placed on {where}", now,
                              mpi=mpi_world(plans) if facts.spec.launcher == "mpirun" else None)

    def begin_attempt(self, row: Any) -> int:
        """Count the job's next attempt and fence off the older ones' checkpoints; its number."""
        row.attempt += 1
        if row.attempt > 1:
            self._fence_checkpoints(row)
        return row.attempt

    @staticmethod
    def record_placement(rows: Rows, row: Any, plans: Any, where: str, now: float, mpi: dict | None = None) -> None:
        """The attempt's launches (``plans``) and its event (``where``: "placed on …"); ``mpi``: an
        mpirun job's world (kept on its node 0 launch)."""
        rows.placed(row, plans, now, mpi=mpi)
        if JobState(row.state) == JobState.QUEUED:
            rows.set_state(row, JobState.SCHEDULED, where, now)
        else:
            rows.add_event(row, f"attempt {row.attempt} {where}", now)

    def _fence_checkpoints(self, row: Any) -> None:
        """Write the job's new attempt where checkpoint commits look (see torchrelay.train.checkpoint):
        workers of an older attempt still running on a node that lost contact can no longer
        commit or prune. Only restarts need it (attempt 1 has nothing older to fence off)."""
        try:  # a compare-and-swap where the store has one (docs/checkpoints.md): never moves back
            self.store.advance_fence(row.id, row.attempt)
        except StaleAttempt as exc:  # another server placed a newer attempt: say so, the rows decide
            _log.warning("job %s: %s", row.id, exc)
        except (StorageError, OSError) as exc:
            _log.warning("job %s: could not write the checkpoint fence for attempt %d: %s", row.id, row.attempt, exc)


def _alone(launch: Any) -> list | None:
    """``[launch]`` when it is the only launch of its attempt (one node), else None (read them)."""
    return [launch] if launch.nnodes == 1 else None
