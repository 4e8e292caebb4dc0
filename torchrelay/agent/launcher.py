"""One launch of one job attempt on this node: start, tail, classify, stop, over a backend.

Contract:
- ``Launch(assignment, code_dir=, run_dir=, ...)`` does no I/O until ``start``. How its first
  process starts is its backend's (``torchrelay.agent.backends``): ``backend=`` names one, else
  ``default_backend_kind`` picks torchrun for every multi-worker or multi-node launch and, for a
  world of one, the zygote when the agent has one, else a direct start.
- ``Launch.start(master_addr, master_port)`` does not block; the processes run in a new session.
  Every process carries ``RELAY_LAUNCH_ID`` and ``RELAY_LAUNCH_DIR`` in its environment, which is
  how ``stop`` finds all of them (a forked worker itself is tracked by pid and process group,
  see zygote.py). Raises ``RuntimeError`` if already started or stopped, ``ValueError`` on a bad
  address or port, ``OSError`` if torchrun cannot be started.
- ``Launch.poll`` / ``wait`` give the final ``wire.LaunchStatus`` once the launch has exited
  (``exits.classify_exit``: per-rank exits, failed ranks first; ``succeeded`` when every rank's
  script returned, an abort during teardown after that still counting as success).
- ``Launch.take_logs`` / ``take_metrics`` return the records written since the last call
  (thread-safe, never block; the last partial line is sent once the launch exited).
- ``Launch.stop(grace_s)``: the backend's ``signal(SIGTERM)``, ``SIGKILL`` after ``grace_s``,
  then whatever of the launch is left; returns only when no process is left. Idempotent.
- ``Launch.release(ranks, grace_s)``: ends those ranks of a running elastic launch only (the
  server shrank the job; a warm launch's ``WarmBackend.release``), each once; the launch then
  succeeds when the ranks it kept returned (``elastic_survived``). Does not block.
- ``pick_free_port(host)``: a port the OS says is free there now.
- ``cgroup=`` (a ``cgroups.LaunchCgroup``): created by ``start`` before anything runs (a refusal
  raises ``cgroups.CgroupError``, an ``OSError``), every process of the launch starts in it, and
  it is removed once the launch ended, however it ended (also when it never started). A rank the
  kernel's OOM killer ended carries the reason ("memory limit 1 GiB exceeded") in its
  ``RankExit.reason`` and the launch's message.

Files under ``run_dir``: ``logs/rank-R.log`` (tagged lines, see the worker), ``metrics/rank-R.jsonl``,
``status/rank-R.json`` (the worker's marker) and the backend's own log (``torchrun.log``, or
``launch.log`` for a direct launch: the command line, and why it could not start if it could not);
under a torchrun launch also ``torchrun/`` (torchrun's ``--log-dir``: each worker's error file).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from torchrelay import wire
from torchrelay.agent.backends import BackendKind, LaunchBackend, LaunchPlace, make_backend
from torchrelay.agent.cgroups import LaunchCgroup, Release
from torchrelay.agent.commands import build_worker_env, is_direct
from torchrelay.agent.exits import LAST_LINES, classify_exit, describe_rank, exit_message, no_exit_record
from torchrelay.agent.output import LaunchOutput
from torchrelay.agent.processes import end_processes, find_launch_processes, group_alive
from torchrelay.agent.warm import WarmBackend, elastic_min_workers
from torchrelay.agent.zygote import Zygote

log = logging.getLogger(__name__)


def default_backend_kind(assignment: wire.LaunchAssignment, zygote: Zygote | None,
                         warm_zygote: Zygote | None = None) -> BackendKind:
    """An mpirun job: mpirun on node 0, the daemon it hands over elsewhere. A world of one: the
    zygote if there is one, else a direct start; any other launch: its ranks forked from the warm
    zygote if there is one, else torchrun."""
    if assignment.launcher == "mpirun":
        return BackendKind.MPIRUN if assignment.node_rank == 0 else BackendKind.MPI_DAEMON
    if not is_direct(assignment):
        return BackendKind.WARM if warm_zygote is not None else BackendKind.TORCHRUN
    return BackendKind.ZYGOTE if zygote is not None else BackendKind.DIRECT


def has_launcher_process(assignment: wire.LaunchAssignment, zygote: Zygote | None,
                         warm_zygote: Zygote | None = None) -> bool:
    """Whether a launcher process (torchrun, mpirun, orted) shares the launch's cgroup with its
    workers, so that the group's memory limit must allow for it (``cgroup_plan.LAUNCHER_ALLOWANCE``).
    A warm launch counts: it may fall back to torchrun, and node 0's hosts the store."""
    return default_backend_kind(assignment, zygote, warm_zygote) in (
        BackendKind.TORCHRUN, BackendKind.MPIRUN, BackendKind.MPI_DAEMON, BackendKind.WARM)


def backend_for(kind: BackendKind, place: LaunchPlace, zygote: Zygote | None,
                warm_zygote: Zygote | None) -> LaunchBackend:
    """The backend of ``kind`` (``WARM`` needs ``warm_zygote``). Raises ``ValueError``."""
    if kind is not BackendKind.WARM:
        return make_backend(kind, place, zygote)
    if warm_zygote is None:
        raise ValueError("a warm launch needs the agent's warm zygote; give warm_zygote=")
    elastic = elastic_min_workers(place.assignment.env) is not None
    return WarmBackend(place, warm_zygote, stop_peers_on_failure=not elastic)


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS says is free on ``host`` right now (bind port 0, read it, release)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def elastic_survived(ranks: list[wire.RankExit], min_workers: int | None,
                     released: frozenset[int] = frozenset()) -> bool:
    """Whether an elastic launch succeeded although some ranks failed: at least ``min_workers``
    of its ranks returned (the others left the job, which went on without them), or some were
    ``released`` (the server shrank the job) and every other rank returned."""
    if min_workers is None:
        return False
    if sum(r.returned for r in ranks) >= min_workers:
        return True
    return bool(released) and all(r.returned for r in ranks if r.rank not in released)


def oom_ranks(ranks: list[wire.RankExit], reason: str) -> list[wire.RankExit]:
    """``ranks`` with ``reason`` on those SIGKILLed that did not return (the OOM killer's
    victims: nothing else of the launch sends SIGKILL to a rank that has not been stopped)."""
    return [r.model_copy(update={"reason": reason}) if r.signal == signal.SIGKILL and not r.returned else r
            for r in ranks]


class Launch:
    """One launch: ``start`` it, ``take_logs``/``take_metrics`` while it runs,
    ``poll``/``wait`` for its ``wire.LaunchStatus``, ``stop`` it.

    ``code_dir`` is the unpacked bundle (the workers' working directory); ``run_dir`` holds
    logs, metrics and markers (created here).
    """

    def __init__(self, assignment: wire.LaunchAssignment, *, code_dir: Path, run_dir: Path,
                 relay_address: str = "", python: str = sys.executable,
                 base_env: Mapping[str, str] | None = None, zygote: Zygote | None = None,
                 cuda_visible_devices: str | None = None, backend: BackendKind | None = None,
                 cgroup: LaunchCgroup | None = None, node_env: Mapping[str, str] | None = None,
                 warm_zygote: Zygote | None = None):
        self.assignment = assignment
        self.run_dir = Path(run_dir)
        self.relay_address = relay_address
        self.cuda_visible_devices = cuda_visible_devices
        self.node_env = dict(node_env or {})  # the node's transports (netif.transport_env)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.cgroup = cgroup
        place = LaunchPlace(assignment=assignment, code_dir=Path(code_dir), run_dir=self.run_dir, python=python,
                            cgroup=cgroup)
        kind = backend or default_backend_kind(assignment, zygote, warm_zygote)
        self.backend: LaunchBackend = backend_for(kind, place, zygote, warm_zygote)
        self.ranks = range(assignment.rank_offset, assignment.rank_offset + assignment.nproc_per_node)
        self._output = LaunchOutput(self.run_dir, self.ranks, attempt=assignment.attempt,
                                    launch_id=assignment.launch_id)
        self._pending_logs: list[wire.LogRecord] = []
        self._pending_metrics: list[wire.MetricRecord] = []
        self._lock = threading.RLock()  # start/stop/poll and the output's reads
        self._started = False
        self._stopped = False
        self._status: wire.LaunchStatus | None = None
        self._released: set[int] = set()  # ranks the server asked to leave (``release``)

    @property
    def launch_id(self) -> str:
        return self.assignment.launch_id

    @property
    def kind(self) -> BackendKind:
        return self.backend.kind

    @property
    def started(self) -> bool:
        return self._started

    @property
    def pid(self) -> int | None:
        """The launch's first process: torchrun, or the direct worker (None before start)."""
        return self.backend.pid

    @property
    def forked(self) -> bool:
        """Whether the zygote forked the worker (a warm launch: its ranks)."""
        return self.backend.forked

    @property
    def note(self) -> str:
        """How it started, when worth a job event (e.g. why a warm launch fell back to torchrun)."""
        return self.backend.note

    @property
    def launcher_log(self) -> Path:
        return self.backend.log_path

    def start(self, master_addr: str, master_port: int) -> None:
        """Start the launch in a new session; does not block (see the module docstring)."""
        with self._lock:
            if self._started or self._stopped:
                raise RuntimeError(f"launch {self.launch_id} was already started or stopped")
            for sub in ("logs", "metrics", "status"):
                (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
            env = build_worker_env(self.assignment, base_env=self.base_env, run_dir=self.run_dir,
                                   relay_address=self.relay_address, cuda_visible_devices=self.cuda_visible_devices,
                                   node_env=self.node_env)
            try:
                if self.cgroup is not None:
                    self.cgroup.create()
                self.backend.start(env, master_addr, master_port)
            except BaseException:
                if self.cgroup is not None:
                    self.cgroup.release()
                raise
            self._started = True

    # -------------------------------------------------------------- logs and metrics

    def _read_output(self, final: bool) -> None:
        logs, metrics = self._output.read(final)
        self._pending_logs += logs
        self._pending_metrics += metrics

    def take_logs(self) -> list[wire.LogRecord]:
        """Log records written since the last call (thread-safe, does not block)."""
        with self._lock:
            self._read_output(final=self._status is not None)
            records, self._pending_logs = self._pending_logs, []
            return records

    def take_metrics(self) -> list[wire.MetricRecord]:
        """Metric records written since the last call (thread-safe, does not block)."""
        with self._lock:
            self._read_output(final=self._status is not None)
            records, self._pending_metrics = self._pending_metrics, []
            return records

    # -------------------------------------------------------------- exit

    def _markers(self) -> dict[int, dict]:
        markers = {}
        for rank in self.ranks:
            try:
                markers[rank] = json.loads((self.run_dir / "status" / f"rank-{rank}.json").read_text())
            except (OSError, ValueError):
                pass
        return markers

    def _launcher_tail(self, lines: int = LAST_LINES) -> list[str]:
        try:
            text = self.launcher_log.read_text(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-lines:]

    def _finish(self) -> wire.LaunchStatus:
        self._read_output(final=True)
        ranks, succeeded = classify_exit(self.ranks, self._markers(), self._output.last_lines)
        succeeded = succeeded or elastic_survived(ranks, elastic_min_workers(self.assignment.env),
                                                  frozenset(self._released))
        released = self.cgroup.release() if self.cgroup is not None else Release(0, None)
        if released.reason:
            ranks = oom_ranks(ranks, released.reason)
        tail = self._launcher_tail(8) if self._started and not succeeded and no_exit_record(ranks) else []
        message = exit_message(ranks, succeeded=succeeded, started=self._started, stopped=self._stopped,
                               unstarted=self.backend.unstarted, first_process=self.backend.first_process,
                               returncode=self.backend.returncode, launcher_tail=tail)
        left = [r for r in ranks if not r.returned]
        if succeeded and left:  # an elastic launch that went on without some of its ranks
            message = (f"{len(ranks) - len(left)} of {len(ranks)} ranks returned (elastic; left: "
                       + "; ".join(describe_rank(r) + (" (released)" if r.rank in self._released else "")
                                   for r in left) + ")")
        if released.reason and released.reason not in message:
            message = f"{released.reason}; {message}"
        return wire.LaunchStatus(state="exited", ranks=ranks, succeeded=succeeded,
                                 stopped=self._stopped, message=message)

    def poll(self) -> wire.LaunchStatus | None:
        """The final status once the launch has exited, else None (does not block)."""
        with self._lock:
            if self._status is not None:
                return self._status
            if not self._started:
                if self._stopped:
                    self._status = self._finish()
                return self._status
            if not self.backend.poll():
                return None
            # torchrun waits for its workers unless it died itself, and a worker's children may
            # outlive it (torchrun ends its workers' process groups): end what is left
            self._kill_leftovers(grace_s=2.0)
            self._status = self._finish()
            return self._status

    def wait(self, timeout: float | None = None) -> wire.LaunchStatus | None:
        """Block until the launch exits and return the final status (None after ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.poll()
            if status is not None:
                return status
            step = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if step <= 0:
                return None
            if self._started:
                self.backend.wait(step)
            else:
                time.sleep(step)

    def release(self, ranks: list[int], grace_s: float) -> None:
        """End ``ranks`` of this running launch only (see the module docstring)."""
        with self._lock:
            new = [rank for rank in ranks if rank in self.ranks and rank not in self._released]
            if not new or not self._started or self._status is not None:
                return
            self._released.update(new)
            release = getattr(self.backend, "release", None)
        if release is None or not release(new, max(grace_s, 0.0)):
            log.warning("launch %s: cannot end ranks %s alone (%s backend); they run on",
                        self.launch_id, new, self.backend.kind.value)

    def remaining_processes(self) -> list[int]:
        """Live pids of this launch (torchrun, supervisors, scripts and their children)."""
        pids = set(find_launch_processes(self.launch_id, self.run_dir))
        if self._started and self.pid is not None and not self.backend.poll():
            pids.add(self.pid)
        return sorted(pids)

    def stop(self, grace_s: float = 10.0) -> wire.LaunchStatus:
        """SIGTERM the launch, SIGKILL what is left after ``grace_s``; blocks until no process
        of the launch is left. Idempotent; returns the final status (``stopped`` is set when
        this call ended a launch that had not exited yet)."""
        with self._lock:
            if self.poll() is not None:
                # its first process is gone; make sure nothing it left behind survives
                self._kill_leftovers(grace_s)
                return self._status
            self._stopped = True
            started = self._started
        grace_s = max(grace_s, 0.0)
        deadline = time.monotonic() + grace_s
        if started:
            self.backend.signal(signal.SIGTERM)
            if not self.backend.wait(grace_s):
                self.backend.signal(signal.SIGKILL)
                self.backend.wait(None)
        self._kill_leftovers(max(0.0, deadline - time.monotonic()))
        status = self.poll()
        assert status is not None
        return status

    def _kill_leftovers(self, grace_s: float) -> None:
        """End the processes still tagged with this launch, and what is left in the backend's
        ``leftover_groups``: SIGTERM, SIGKILL after ``grace_s``."""
        groups = self.backend.leftover_groups()

        def left() -> list[int]:
            pids = find_launch_processes(self.launch_id, self.run_dir)
            pids += [-group for group in groups if group_alive(group)]
            return pids

        end_processes(left, grace_s)
