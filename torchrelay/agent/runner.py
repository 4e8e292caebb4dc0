"""One launch on this node, driven in a thread of its own: prepare, start, watch, stop, report.

Contract:
- ``LaunchRunner(assignment, deps)`` does nothing until ``start()``, which starts its thread.
  The thread reports each state change through ``deps.report`` (in order): ``preparing``; for
  node 0 of a multi-node or multi-worker launch ``preparing`` again with the master port it
  picked, before anything starts, so that the other nodes get it; ``running`` once the launch
  started (node 0's carries the port again, and for an mpirun job the daemon command line of
  every other node, once its mpirun wrote them all: docs/mpi.md); ``exited`` with the launch's
  final status.
- Node 0 picks the rendezvous port on ``deps.host``; the other nodes wait for
  ``master_addr``/``master_port`` (and in an mpirun job their daemon) in a later assignment
  (``update``). The code is prepared with
  ``deps.prepare_code``, tried again while the server cannot be reached (``ServerUnreachable``),
  until the launch is stopped; any other failure there ends the launch, reported.
- A launch with GPUs takes ``RELAY_GPUS_PER_WORKER`` × workers device indices from
  ``deps.gpu_slots`` (a shortage ends it, reported) and gives them back when it exits.
- While the launch runs, its new log and metric records go to ``deps.outbox`` every
  ``deps.ship_interval_s``; the last ones go before its ``exited`` is reported, so the outbox
  holds a launch's lines ahead of its end. Only this thread takes its launch's records.
- Ranks a later assignment lists in ``released_ranks`` (the server shrank an elastic job) are
  ended alone (``Launch.release``); the launch goes on.
- ``request_stop()`` (idempotent) stops the launch with the assignment's ``stop_grace_s`` (the
  job's, so that workers can commit a checkpoint on SIGTERM), or ends it before it starts.
- Whatever goes wrong in the agent itself, the launch ends reported ("agent error: ...").
"""
from __future__ import annotations

import logging
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torchrelay import wire
from torchrelay.agent.commands import is_direct
from torchrelay.agent.gpus import GpuShortage, GpuSlots, visible_devices
from torchrelay.agent.launcher import pick_free_port
from torchrelay.agent.mpi import read_handoffs
from torchrelay.agent.outbox import Outbox
from torchrelay.agent.reconcile import LaunchState
from torchrelay.agent.server_link import ServerRefused, ServerUnreachable

log = logging.getLogger(__name__)

WATCH_S = 0.1  # how often a running launch is checked for its end and for a stop request


class LaunchHandle(Protocol):
    """What a runner needs of a launch (``launcher.Launch``, or a fake in tests)."""

    def start(self, master_addr: str, master_port: int) -> None: ...

    def wait(self, timeout: float | None = None) -> wire.LaunchStatus | None: ...

    def stop(self, grace_s: float = 10.0) -> wire.LaunchStatus: ...

    def take_logs(self) -> list[wire.LogRecord]: ...

    def take_metrics(self) -> list[wire.MetricRecord]: ...


class LaunchFactory(Protocol):
    def __call__(self, assignment: wire.LaunchAssignment, *, code_dir: Path, run_dir: Path,
                 cuda_visible_devices: str | None) -> LaunchHandle: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerDeps:
    """What the agent lends each runner."""

    host: str  # node 0's address for the rendezvous
    work_dir: Path  # launch folders are work_dir/launches/<launch_id>
    prepare_code: Callable[[wire.LaunchAssignment, Path], Path]  # (assignment, run_dir) -> code dir
    new_launch: LaunchFactory
    gpu_slots: GpuSlots
    node_gpus: int
    outbox: Outbox
    report: Callable[[LaunchRunner, wire.LaunchStatus], None]  # a state change, in order
    records_queued: Callable[[], None]  # the outbox got records
    ship_interval_s: float
    stop_grace_s: float  # for a launch the agent itself must end


class LaunchRunner:
    """Drives one launch in its own thread (see the module docstring)."""

    def __init__(self, assignment: wire.LaunchAssignment, deps: RunnerDeps):
        self.assignment = assignment
        self.deps = deps
        self.launch_id = assignment.launch_id
        self.run_dir = deps.work_dir / "launches" / self.launch_id
        self.state = LaunchState.PREPARING  # set by ``deps.report``'s owner, under its lock
        self.launch: LaunchHandle | None = None
        self._stop_requested = threading.Event()
        self._assignment_changed = threading.Condition()
        self.thread = threading.Thread(target=self._main, name=f"relay-launch-{self.launch_id}", daemon=True)

    @property
    def direct(self) -> bool:
        return is_direct(self.assignment)

    def start(self) -> None:
        self.thread.start()

    def update(self, assignment: wire.LaunchAssignment) -> None:
        with self._assignment_changed:
            self.assignment = assignment
            self._assignment_changed.notify_all()

    def request_stop(self) -> None:
        self._stop_requested.set()
        with self._assignment_changed:
            self._assignment_changed.notify_all()

    # -------------------------------------------------------------- the thread

    def _main(self) -> None:
        try:
            self._exit(self._drive())
        except Exception as exc:  # noqa: BLE001 - a launch must end reported, whatever broke
            log.exception("launch %s failed in the agent", self.launch_id)
            if self.launch is not None:
                status = self.launch.stop(self.deps.stop_grace_s)
                status.message = f"agent error: {exc}; {status.message}"
                self._flush_records()
            else:
                status = wire.LaunchStatus(state="exited", succeeded=False, stopped=self._stop_requested.is_set(),
                                           message=f"agent error: {type(exc).__name__}: {exc}")
            self._exit(status)

    def _exit(self, status: wire.LaunchStatus) -> None:
        self.deps.gpu_slots.release(self.launch_id)
        self.deps.report(self, status)

    def _unstarted(self, message: str, stopped: bool | None = None) -> wire.LaunchStatus:
        stopped = self._stop_requested.is_set() if stopped is None else stopped
        return wire.LaunchStatus(state="exited", succeeded=False, stopped=stopped, message=message)

    def _drive(self) -> wire.LaunchStatus:
        """Prepare, start and watch the launch; its final status."""
        assignment = self.assignment
        self.deps.report(self, wire.LaunchStatus(state="preparing"))
        try:
            code_dir = self._prepare_code(assignment)
        except (OSError, ServerRefused, tarfile.TarError, ValueError) as exc:
            return self._unstarted(f"cannot prepare bundle {assignment.bundle!r}: {exc}")
        rendezvous = self._rendezvous()
        if self._stop_requested.is_set():
            return self._unstarted("stopped before it started", stopped=True)
        master_addr, master_port = rendezvous
        gpus_per_worker = int(self.assignment.env.get("RELAY_GPUS_PER_WORKER", "0") or 0)
        try:
            devices = self.deps.gpu_slots.take(self.launch_id, self.assignment.nproc_per_node * gpus_per_worker)
        except GpuShortage as exc:
            return self._unstarted(str(exc), stopped=False)
        self.launch = launch = self.deps.new_launch(
            self.assignment, code_dir=code_dir, run_dir=self.run_dir,
            cuda_visible_devices=visible_devices(devices, self.deps.node_gpus))
        launch.start(master_addr, master_port)
        node0_port = master_port if assignment.node_rank == 0 else None
        daemons, ended = self._mpi_handoffs(launch) if self._mpi_head else ({}, None)
        if ended is not None:
            self._flush_records()
            return ended
        note = getattr(launch, "note", "")  # e.g. why a warm launch went through torchrun
        self.deps.report(self, wire.LaunchStatus(state="running", master_port=node0_port, mpi_daemons=daemons,
                                                 message=note))
        status = self._watch(launch)
        self._flush_records()  # its last lines go ahead of its end
        return status

    @property
    def _mpi_head(self) -> bool:
        """Node 0 of an mpirun job across nodes: its mpirun hands the others their daemons."""
        return self.assignment.launcher == "mpirun" and self.assignment.node_rank == 0 and self.assignment.nnodes > 1

    def _mpi_handoffs(self, launch: LaunchHandle) -> tuple[dict[int, str], wire.LaunchStatus | None]:
        """Node 0 of an mpirun job: the daemon command lines its mpirun wrote for every other
        node (``torchrelay.agent.mpi``), once all are there; or the launch's final status if it
        ended (or was stopped) first."""
        wanted = set(range(1, self.assignment.nnodes))
        while True:
            daemons = read_handoffs(self.run_dir)
            if wanted <= daemons.keys():
                return daemons, None
            status = launch.wait(timeout=WATCH_S)
            if status is not None:
                return {}, status
            if self._stop_requested.is_set():
                return {}, launch.stop(self.assignment.stop_grace_s)

    def _peer_ready(self) -> bool:
        """Whether a node other than 0 has what it needs from node 0: its address and port and,
        in an mpirun job, the daemon node 0's mpirun handed over for it."""
        assignment = self.assignment
        if not (assignment.master_addr and assignment.master_port):
            return False
        if assignment.launcher != "mpirun":
            return True
        return assignment.mpi is not None and assignment.node_rank in assignment.mpi.daemons

    def _prepare_code(self, assignment: wire.LaunchAssignment) -> Path:
        """``deps.prepare_code``, tried again while the server cannot be reached (not on a
        refusal such as an unknown bundle), until the launch is stopped."""
        backoff = 0.2
        while True:
            try:
                return self.deps.prepare_code(assignment, self.run_dir)
            except ServerUnreachable as exc:
                if self._stop_requested.wait(backoff):
                    raise
                log.warning("launch %s: fetching bundle failed (%s); retrying", self.launch_id, exc)
                backoff = min(backoff * 2, 5.0)

    def _rendezvous(self) -> tuple[str, int | None]:
        """Node 0: its address and a port it picked (posted first unless a world of one, which
        nobody waits for). Other nodes: node 0's, once an assignment carries them (or a stop)."""
        if self.assignment.node_rank == 0:
            port = pick_free_port(self.deps.host)
            if not self.direct:
                self.deps.report(self, wire.LaunchStatus(state="preparing", master_port=port))
            return self.deps.host, port
        with self._assignment_changed:
            self._assignment_changed.wait_for(lambda: self._stop_requested.is_set() or self._peer_ready())
            return self.assignment.master_addr, self.assignment.master_port

    def _watch(self, launch: LaunchHandle) -> wire.LaunchStatus:
        """Until the launch exits (or is stopped): its records to the outbox as they come, and
        the ranks the server asks to leave (``released_ranks``: a shrink) ended."""
        flushed_at = time.monotonic()
        released: list[int] = []
        while True:
            status = launch.wait(timeout=WATCH_S)
            if status is not None:
                return status
            if self._stop_requested.is_set():
                return launch.stop(self.assignment.stop_grace_s)
            if self.assignment.released_ranks != released and hasattr(launch, "release"):
                released = list(self.assignment.released_ranks)
                launch.release(released, self.assignment.stop_grace_s)
            if time.monotonic() - flushed_at >= self.deps.ship_interval_s:
                self._flush_records()
                flushed_at = time.monotonic()

    def _flush_records(self) -> None:
        launch = self.launch
        if launch is None:
            return
        logs, metrics = launch.take_logs(), launch.take_metrics()
        if not logs and not metrics:
            return
        dropped = self.deps.outbox.put_records(self.launch_id, self.assignment.job_id, logs, metrics)
        if dropped:
            log.warning("launch %s: server unreachable too long, dropped its %d oldest records",
                        self.launch_id, dropped)
        self.deps.records_queued()
