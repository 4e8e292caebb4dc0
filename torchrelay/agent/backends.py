"""How a launch's first process is started, watched and signalled: torchrun, direct, zygote (or MPI).

``launcher.Launch`` owns what every launch shares (its folders, output, exit classification and
stop protocol) and leaves three hooks to a ``LaunchBackend``, the way torch.distributed.elastic's
agent leaves ``_start_workers``/``_monitor_workers``/``_stop_workers`` to its subclasses:
``start`` (does not block), ``poll`` (whether the first process ended; ``returncode`` then),
``wait`` (block up to a timeout for that) and ``signal`` (to the first process's group); plus
``leftover_groups``, process groups ``Launch`` sweeps with the tagged processes after the end.

Contract of the backends:
- ``TorchrunBackend`` (every multi-worker or multi-node launch): torchrun in a new session, its
  output in ``torchrun.log``; it forwards a signal to every worker's session and waits for them.
- ``DirectBackend`` (a world of one): no torchrun, which would add only its own start-up (an
  interpreter importing torch, about 1.5 s of CPU, and its store). The worker gets the
  environment torchrun would give it (``commands.build_rank_env``) and starts as a fresh process
  in a new session; a thread of this process is its supervisor with the worker module's own
  functions (``worker.pump_until_exit``, ``worker.conclude``): the same rank log, marker,
  ``returned`` and blame as under torchrun. A worker that cannot be started is a failed rank with
  exit code 127, as under the supervisor. ``launch.log`` has the command line.
- ``ZygoteBackend``: a direct launch whose worker is forked from the agent's warm interpreter
  (``zygote.Zygote``) when ``zygote.eligible`` allows and the zygote answers (``forked`` then),
  else started as ``DirectBackend`` starts it. A forked worker is reaped by the zygote, which
  reports its wait status.
- ``MpirunBackend`` / ``MpiDaemonBackend`` (``torchrelay.agent.mpi`` has the pure parts): node 0 of an
  mpirun job runs mpirun, every other node the Open MPI daemon mpirun handed over (docs/mpi.md);
  both are ``CommandBackend``s, as torchrun is.

Every backend starts its first process inside the launch's cgroup when the place has one
(``LaunchPlace.cgroup``, see ``torchrelay.agent.cgroups``): a started process through
``LaunchPlace.command`` (it joins before it ``exec``s), a forked one through
``LaunchPlace.join(pid)``, a call any backend can make.
"""
from __future__ import annotations

import abc
import enum
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar

from torchrelay import wire
from torchrelay.agent import mpi, worker
from torchrelay.agent.cgroups import CgroupError, LaunchCgroup
from torchrelay.agent.commands import build_rank_env, build_torchrun_command, direct_command
from torchrelay.agent.processes import signal_group
from torchrelay.agent.target import target_of_entrypoint
from torchrelay.agent.zygote import Zygote, ZygoteError, eligible

log = logging.getLogger(__name__)


class BackendKind(enum.Enum):
    TORCHRUN = "torchrun"
    DIRECT = "direct"
    ZYGOTE = "zygote"
    MPIRUN = "mpirun"  # node 0 of an mpirun job (``torchrelay.agent.mpi`` has the pure parts)
    MPI_DAEMON = "mpi_daemon"  # another node of it
    WARM = "warm"  # every rank forked from the warm zygote (``torchrelay.agent.warm``)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlace:
    """Where a launch runs: its assignment, the workers' working directory (``code_dir``), its
    folder of logs, metrics and markers (``run_dir``), and the interpreter of hosted workers."""

    assignment: wire.LaunchAssignment
    code_dir: Path
    run_dir: Path
    python: str
    cgroup: LaunchCgroup | None = None  # the launch's cgroup (created), or None: no limits

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as started: joining the launch's cgroup first when there is one."""
        return argv if self.cgroup is None else self.cgroup.wrap(argv)

    def join(self, pid: int) -> None:
        """Put a process started some other way (forked) into the launch's cgroup. Raises
        ``cgroups.CgroupError``, except for a process that already ended (a forked ``python -c
        pass`` can end before it is moved: a zombie cannot join, and nothing of it is left to
        limit; its parent reports how it ended)."""
        if self.cgroup is None:
            return
        try:
            self.cgroup.add(pid)
        except CgroupError:
            if _running(pid):
                raise


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class LaunchBackend(abc.ABC):
    """The hooks of one launch's first process (see the module docstring)."""

    kind: ClassVar[BackendKind]
    log_name: ClassVar[str]  # the backend's own log in the run folder
    first_process: ClassVar[str]  # what it starts, as messages name it
    unstarted: ClassVar[str]  # the message of a launch stopped before it started

    def __init__(self, place: LaunchPlace):
        self.place = place
        self.pid: int | None = None  # the first process, once started
        self.returncode: int | None = None  # once ``poll``/``wait`` saw it end
        self.forked = False
        self.note = ""  # how it started, when worth an event (e.g. why a warm launch fell back)

    @property
    def log_path(self) -> Path:
        return self.place.run_dir / self.log_name

    @abc.abstractmethod
    def start(self, env: dict[str, str], master_addr: str, master_port: int) -> None:
        """Start the first process with ``env``; does not block. Raises ``ValueError`` on a bad
        address or port, ``OSError`` when the process cannot be started at all."""

    @abc.abstractmethod
    def poll(self) -> bool:
        """Whether the first process has ended (``returncode`` is then set). Does not block."""

    @abc.abstractmethod
    def wait(self, timeout: float | None) -> bool:
        """Block until the first process ended (True) or ``timeout`` s passed (False)."""

    @abc.abstractmethod
    def signal(self, sig: int) -> None:
        """Send ``sig`` to the first process's group; nothing if it is gone."""

    def leftover_groups(self) -> list[int]:
        """Process groups to sweep after the end besides the tagged processes."""
        return []


class CommandBackend(LaunchBackend):
    """A first process that is one command line in a new session, its output in the backend's
    log: torchrun, or an MPI job's mpirun or Open MPI daemon. Subclasses give ``command``."""

    def __init__(self, place: LaunchPlace):
        super().__init__(place)
        self._proc: subprocess.Popen | None = None

    @abc.abstractmethod
    def command(self, env: dict[str, str], master_addr: str, master_port: int) -> tuple[list[str], dict[str, str]]:
        """The argv and the environment to start. Raises ``ValueError`` on a value it cannot use."""

    def start(self, env: dict[str, str], master_addr: str, master_port: int) -> None:
        cmd, env = self.command(env, master_addr, master_port)
        with open(self.log_path, "ab") as out:
            out.write(f"$ {shlex.join(cmd)}\n".encode())
            out.flush()
            self._proc = subprocess.Popen(self.place.command(cmd), cwd=self.place.code_dir, env=env,
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.pid = self._proc.pid

    def poll(self) -> bool:
        assert self._proc is not None, "poll before start"
        self.returncode = self._proc.poll()
        return self.returncode is not None

    def wait(self, timeout: float | None) -> bool:
        assert self._proc is not None, "wait before start"
        try:
            self.returncode = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def signal(self, sig: int) -> None:
        if self.pid is not None:
            signal_group(self.pid, sig)


class TorchrunBackend(CommandBackend):
    kind = BackendKind.TORCHRUN
    log_name = "torchrun.log"
    first_process = "torchrun"
    unstarted = "stopped before torchrun started"

    def command(self, env: dict[str, str], master_addr: str, master_port: int) -> tuple[list[str], dict[str, str]]:
        return build_torchrun_command(self.place.assignment, master_addr=master_addr, master_port=master_port,
                                      log_dir=self.place.run_dir / "torchrun", python=self.place.python), env


class _MpiBackend(CommandBackend):
    """What both ends of an MPI world share: each node's ranks get the torch.distributed
    variables of their node (``RANK`` etc. then set per rank by ``mpi_rank``), its first rank and
    its code folder, and Open MPI's settings for running across agents."""

    def __init__(self, place: LaunchPlace):
        super().__init__(place)
        self.session = mpi.session_dir(place.run_dir, tempfile.gettempdir())

    def node_env(self, env: dict[str, str], master_addr: str, master_port: int) -> dict[str, str]:
        assignment = self.place.assignment
        for folder in (self.session, mpi.shm_dir(self.session)):
            os.makedirs(folder, exist_ok=True)
        out = {**mpi.mpirun_env(master_addr), **env}  # the job's env may override Open MPI's
        out.update(mpi.node_env(master_addr, self.session, daemon=self.kind is BackendKind.MPI_DAEMON))
        out.update(build_rank_env(assignment, master_addr=master_addr, master_port=master_port,
                                  rank=assignment.rank_offset))
        out[mpi.RANK_OFFSET_VAR] = str(assignment.rank_offset)
        out[mpi.CODE_DIR_VAR] = str(self.place.code_dir.absolute())
        return out

    def poll(self) -> bool:
        return self._ended(super().poll())

    def wait(self, timeout: float | None) -> bool:
        return self._ended(super().wait(timeout))

    def _ended(self, ended: bool) -> bool:
        if ended:  # Open MPI leaves its folders' tops behind; nothing of them is needed now
            for folder in (self.session, mpi.shm_dir(self.session)):
                shutil.rmtree(folder, ignore_errors=True)
        return ended


class MpirunBackend(_MpiBackend):
    """Node 0 of an mpirun job: ``mpirun`` over every node's slots, our remote shell handing each
    other node's daemon to its agent (``torchrelay.agent.mpi``)."""

    kind = BackendKind.MPIRUN
    log_name = "mpirun.log"
    first_process = "mpirun"
    unstarted = "stopped before mpirun started"

    def command(self, env: dict[str, str], master_addr: str, master_port: int) -> tuple[list[str], dict[str, str]]:
        assignment = self.place.assignment
        slots = assignment.mpi.slots if assignment.mpi is not None else [assignment.nproc_per_node]
        if sum(slots) != assignment.world_size or len(slots) != assignment.nnodes:
            raise ValueError(f"MPI slots {slots} do not make the assignment's world of {assignment.world_size} on "
                             f"{assignment.nnodes} node(s)")
        worker_argv = target_of_entrypoint(assignment.entrypoint, self.place.python).worker_argv()
        argv = mpi.mpirun_command(slots=slots, python=self.place.python, worker_argv=worker_argv,
                                  mpirun=env.get("RELAY_MPIRUN", "mpirun"), as_root=os.geteuid() == 0)
        return argv, self.node_env(env, master_addr, master_port)


class MpiDaemonBackend(_MpiBackend):
    """Another node of an mpirun job: the Open MPI daemon node 0's mpirun handed over, run by
    ``/bin/sh -c`` as sshd would run it; this node's ranks are its children."""

    kind = BackendKind.MPI_DAEMON
    log_name = "orted.log"
    first_process = "the Open MPI daemon (orted)"
    unstarted = "stopped before the Open MPI daemon started"

    def command(self, env: dict[str, str], master_addr: str, master_port: int) -> tuple[list[str], dict[str, str]]:
        assignment = self.place.assignment
        daemon = (assignment.mpi.daemons.get(assignment.node_rank) if assignment.mpi is not None else None)
        if not daemon:
            raise ValueError(f"launch {assignment.launch_id}: node 0's mpirun has not handed over node "
                             f"{assignment.node_rank}'s daemon yet")
        return ["/bin/sh", "-c", daemon], self.node_env(env, master_addr, master_port)


@dataclass(frozen=True, slots=True)
class _Spawned:
    pid: int
    reap: Callable[[int, bool], int | None]  # (pid, block) -> wait status once it ended
    proc: subprocess.Popen | None = None  # a fresh process (its returncode is set once reaped)


class DirectBackend(LaunchBackend):
    kind = BackendKind.DIRECT
    log_name = "launch.log"
    first_process = "the worker"
    unstarted = "stopped before it started"

    def __init__(self, place: LaunchPlace, rank: int | None = None):
        super().__init__(place)
        self.target = target_of_entrypoint(place.assignment.entrypoint, place.python)
        self.rank = place.assignment.rank_offset if rank is None else rank
        self.marker = str(place.run_dir / "status" / f"rank-{self.rank}.json")
        self._exited = threading.Event()  # the worker was reaped and its marker written

    def rank_env(self, master_addr: str, master_port: int) -> dict[str, str]:
        """The variables torchrun would add for this rank (``commands.build_rank_env``)."""
        return build_rank_env(self.place.assignment, master_addr=master_addr, master_port=master_port,
                              rank=self.rank)

    def start(self, env: dict[str, str], master_addr: str, master_port: int) -> None:
        env = {**env, **self.rank_env(master_addr, master_port)}
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # as torchrun: the caller's, else 1
        marker = self.marker
        try:
            os.remove(marker)  # a marker left by an earlier run must not speak for this one
        except FileNotFoundError:
            pass
        rank_log = worker.RankLog(str(self.place.run_dir / "logs" / f"rank-{self.rank}.log"))
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        with open(self.log_path, "ab") as launch_log:
            try:
                spawned = self._spawn(env, out_write, err_write, launch_log)
            except OSError as exc:
                os.close(out_read)
                os.close(err_read)
                self._cannot_start(exc, launch_log, rank_log, marker)
                return
            except BaseException:  # e.g. a warm rank the zygote refused: the caller falls back
                os.close(out_read)
                os.close(err_read)
                rank_log.close()
                raise
            finally:
                os.close(out_write)
                os.close(err_write)
        self.pid = spawned.pid
        threading.Thread(target=self._supervise, name=f"relay-supervise-{self.place.assignment.launch_id}-{self.rank}",
                         args=(spawned, {out_read: "o", err_read: "e"}, rank_log, marker), daemon=True).start()

    def _spawn(self, env: dict[str, str], stdout: int, stderr: int, launch_log: BinaryIO) -> _Spawned:
        """Start the worker as a fresh process in a new session. Raises ``OSError``."""
        argv = direct_command(self.target, self.place.python)
        launch_log.write(f"$ {shlex.join(argv)}\n".encode())
        proc = subprocess.Popen(self.place.command(argv), cwd=self.place.code_dir, env=env, stdin=subprocess.DEVNULL,
                                stdout=stdout, stderr=stderr, start_new_session=True)
        return _Spawned(proc.pid, worker.waitpid_status, proc)

    def _cannot_start(self, exc: OSError, launch_log: BinaryIO, rank_log: worker.RankLog, marker: str) -> None:
        """The rank's record of a worker that could not be started (exit code 127)."""
        launch_log.write(f"cannot start: {exc}\n".encode())
        rank_log.note(f"torchrelay worker: cannot start {self.target.target!r}: {exc}")
        rank_log.close()
        final = worker.final_marker(None, 127, None, exec_mode=not self.target.hosted)
        worker.write_marker({**final, "pid": None, "ended_at": time.time()}, marker)
        self.returncode = 127
        self._exited.set()

    def _supervise(self, spawned: _Spawned, streams: dict[int, str], rank_log: worker.RankLog,
                   marker: str) -> None:
        """The worker supervisor's job (see ``torchrelay.agent.worker``): copy output, reap,
        write the final marker; then say the worker exited."""
        try:
            try:
                status = worker.pump_until_exit(spawned.pid, streams, rank_log, spawned.reap)
            except OSError:
                log.exception("launch %s: copying the worker's output failed", self.place.assignment.launch_id)
                for fd in streams:  # whatever is still open: the worker gets EPIPE, not a hang
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                status = spawned.reap(spawned.pid, True)
            self.returncode = os.waitstatus_to_exitcode(status)
            if spawned.proc is not None:
                spawned.proc.returncode = self.returncode  # reaped here, not by Popen
            worker.conclude(spawned.pid, status, exec_mode=not self.target.hosted, path=marker,
                            rank_log=rank_log, rank=self.rank)
        except Exception:  # noqa: BLE001 - the launch must still end; the launch then finds no record
            log.exception("launch %s: supervising the worker failed", self.place.assignment.launch_id)
        finally:
            self._exited.set()

    def poll(self) -> bool:
        return self._exited.is_set()

    def wait(self, timeout: float | None) -> bool:
        return self._exited.wait(timeout)

    def signal(self, sig: int) -> None:
        if self.pid is not None:  # the worker's own group: the script and the children it did not move
            signal_group(self.pid, sig)

    def leftover_groups(self) -> list[int]:
        # a forked worker's children carry the zygote's environment, not the launch's
        return [self.pid] if self.pid is not None else []


class ZygoteBackend(DirectBackend):
    kind = BackendKind.ZYGOTE

    def __init__(self, place: LaunchPlace, zygote: Zygote, rank: int | None = None):
        super().__init__(place, rank)
        self.zygote = zygote

    def _spawn(self, env: dict[str, str], stdout: int, stderr: int, launch_log: BinaryIO) -> _Spawned:
        """Fork the worker from the zygote when it may, else start it as a fresh process."""
        if eligible(self.target, env, python=self.place.python, zygote_python=self.zygote.python,
                    zygote_env=self.zygote.env):
            try:
                pid = self.zygote.spawn(self.target, env=env, cwd=str(self.place.code_dir), stdout=stdout,
                                        stderr=stderr)
            except ZygoteError as exc:
                log.warning("launch %s: zygote refused (%s); starting the worker instead",
                            self.place.assignment.launch_id, exc)
            else:
                try:
                    self.place.join(pid)
                except CgroupError:
                    os.killpg(pid, signal.SIGKILL)  # never let it run outside its limits
                    raise
                argv = direct_command(self.target, self.place.python)
                launch_log.write(f"$ {shlex.join(argv)}  # forked by the zygote, pid {pid}\n".encode())
                self.forked = True
                return _Spawned(pid, self.zygote.wait_status)
        return super()._spawn(env, stdout, stderr, launch_log)


def make_backend(kind: BackendKind, place: LaunchPlace, zygote: Zygote | None = None) -> LaunchBackend:
    """The backend of ``kind`` for ``place`` (``ZYGOTE`` needs ``zygote``). Raises ``ValueError``."""
    if kind is BackendKind.TORCHRUN:
        return TorchrunBackend(place)
    if kind is BackendKind.MPIRUN:
        return MpirunBackend(place)
    if kind is BackendKind.MPI_DAEMON:
        return MpiDaemonBackend(place)
    if kind is BackendKind.DIRECT:
        return DirectBackend(place)
    if zygote is None:
        raise ValueError("a zygote backend needs the agent's zygote; give zygote=")
    return ZygoteBackend(place, zygote)
