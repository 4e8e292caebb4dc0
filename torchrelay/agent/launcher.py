"""One launch of one job attempt on this node: build, start, tail, classify, stop.

Contract:
- ``build_torchrun_command`` / ``build_direct_command`` / ``build_worker_env`` /
  ``build_rank_env`` / ``worker_argv`` are pure: an assignment in, an argv or environment out.
- Two ways to start, chosen by ``is_direct`` (pure):
  * **torchrun** (every multi-worker or multi-node launch), with static rendezvous
    (``--nnodes``, ``--node-rank``, ``--nproc-per-node``, ``--master-addr``,
    ``--master-port``, ``--max-restarts 0``); every worker goes through
    ``torchrelay.agent.worker`` (the exit hook): ``python[3[.X]] X.py ...`` and
    ``python -m mod ...`` run in-process under the hook; any other entrypoint runs as a program
    (``--exec``) under the same supervisor, so every rank gets an exit record, log files and
    process-group ownership the same way.
  * **direct** (a world of one: one node, one worker). torchrun would add only its own start-up
    (an interpreter importing torch, about 1.5 s of CPU, plus its store) and nothing else: there
    is no rendezvous and no peer to wait for. The launch starts the worker itself with the
    environment torchrun would give it (``build_rank_env``) and is its supervisor: a thread of
    this process copies its stdout/stderr into the rank log and writes the final marker with the
    worker module's own functions, so logs, markers, ``returned``/blame and stop semantics are
    the same. A hosted script runs as ``python -m torchrelay.agent.worker --no-supervisor ...``
    (one interpreter, the exit hook in it); any other program is started as it is (no
    interpreter of ours at all).
- ``Launch.start`` does not block; the processes run in a new session. Every process carries
  ``RELAY_LAUNCH_ID`` and ``RELAY_LAUNCH_DIR`` in its environment, which is how ``stop`` finds
  all of them (a forked worker itself is tracked by pid and process group, see zygote.py).
- ``Launch.poll`` / ``wait`` give the final ``wire.LaunchStatus`` once the launch has exited:
  per-rank ``RankExit`` (exit code, signal, returned, last 20 lines), ``succeeded`` = every
  rank's script returned (an abort during teardown after that still counts as success).
- ``Launch.take_logs`` / ``take_metrics`` return the records written since the last call
  (thread-safe; lines are complete, the last partial line is sent once the launch exited).
- ``Launch.stop(grace_s)``: SIGTERM (to torchrun, which forwards it to the workers; or to the
  direct worker's process group), SIGKILL to everything of the launch after ``grace_s``;
  returns only when no process is left. Idempotent.

Files under ``run_dir``: ``logs/rank-R.log`` (tagged lines, see the worker), ``metrics/rank-R.jsonl``,
``status/rank-R.json`` (the worker's marker) and ``torchrun.log`` (torchrun's own output; for a
direct launch ``launch.log``: the command line, and why it could not start if it could not).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from torchrelay import wire
from torchrelay.agent import worker
from torchrelay.agent.zygote import Zygote, ZygoteError, eligible

log = logging.getLogger(__name__)

LAST_LINES = 20
MAX_LINE_BYTES = 64 * 1024  # a longer "line" is cut and sent in pieces
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")
WORKER_MODULE = "torchrelay.agent.worker"


# ---------------------------------------------------------------- pure: commands and env


def worker_argv(entrypoint: Sequence[str], python: str | None = None) -> list[str]:
    """Arguments for ``python -m torchrelay.agent.worker`` that run ``entrypoint``.

    A ``python``/``python3``/``python3.X`` the hook cannot host (``-c``, other flags) runs as
    ``python`` (the agent's interpreter, as hosted scripts do) when that is given.

    ``["python", "train.py", "--lr", "1"]`` -> ``["train.py", "--lr", "1"]``;
    ``["python3", "-m", "pkg.mod", "x"]`` -> ``["-m", "pkg.mod", "x"]``;
    ``["python", "-u", "train.py"]`` -> ``["train.py"]`` (workers are unbuffered anyway);
    anything else -> ``["--exec", *entrypoint]``. Raises ``ValueError`` on an empty one.
    """
    argv = list(entrypoint)
    if not argv or not argv[0]:
        raise ValueError(f"entrypoint {entrypoint!r} is empty; give e.g. ['python', 'train.py']")
    if not _PYTHON_RE.match(os.path.basename(argv[0])):
        return ["--exec", *argv]
    rest = argv[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return ["-m", *rest[1:]]
    if rest and not rest[0].startswith("-"):
        return rest
    # `python -c ...`, `python -O x.py`, bare `python`: not a script we can host; run as is
    return ["--exec", python or argv[0], *argv[1:]]


def build_torchrun_command(assignment: wire.LaunchAssignment, *, master_addr: str,
                           master_port: int, python: str = sys.executable,
                           shutdown_timeout_s: int = 10) -> list[str]:
    """The torchrun argv for ``assignment`` (pure)."""
    if not master_addr:
        raise ValueError(f"master_addr {master_addr!r} is empty; node 0's address is needed")
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master_port {master_port!r} is not a TCP port (1..65535)")
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(assignment.nnodes),
        "--node-rank", str(assignment.node_rank),
        "--nproc-per-node", str(assignment.nproc_per_node),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--max-restarts", "0",
        "--shutdown-timeout", str(int(shutdown_timeout_s)),
        "-m", WORKER_MODULE, *worker_argv(assignment.entrypoint, python),
    ]


def build_worker_env(assignment: wire.LaunchAssignment, *, base_env: Mapping[str, str],
                     run_dir: Path, relay_address: str, cuda_visible_devices: str | None = None) -> dict[str, str]:
    """torchrun's environment (it passes it on to every worker) (pure).

    ``base_env`` + ``assignment.env`` + the ``RELAY_*`` variables; ``OMP_NUM_THREADS``
    defaults to 1 unless either of the first two sets it. ``cuda_visible_devices`` (the
    devices the agent gave this launch, see ``torchrelay.agent.gpus``) wins over both.
    """
    env = dict(base_env)
    env.update(assignment.env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({
        "RELAY_JOB_ID": assignment.job_id,
        "RELAY_ATTEMPT": str(assignment.attempt),
        "RELAY_LAUNCH_ID": assignment.launch_id,
        "RELAY_ADDRESS": relay_address,
        "RELAY_STORE_URL": assignment.store_url,
        "RELAY_JOB_STORE_PREFIX": assignment.job_store_prefix,
        "RELAY_METRICS_DIR": str(run_dir / "metrics"),
        "RELAY_RANK_STATUS_DIR": str(run_dir / "status"),
        "RELAY_LOG_DIR": str(run_dir / "logs"),
        "RELAY_LAUNCH_DIR": os.path.abspath(run_dir),
        "PYTHONUNBUFFERED": "1",
    })
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


def is_direct(assignment: wire.LaunchAssignment) -> bool:
    """Whether ``assignment`` is a world of one (one node, one worker): started without
    torchrun (pure)."""
    return assignment.nnodes == 1 and assignment.nproc_per_node == 1 and assignment.world_size == 1


def build_rank_env(assignment: wire.LaunchAssignment, *, master_addr: str, master_port: int,
                   rank: int = 0) -> dict[str, str]:
    """The variables torchrun's local agent adds for one worker (torch 2.x,
    ``LocalElasticAgent._start_workers`` with static rendezvous), for a direct launch (pure).

    ``TORCHELASTIC_USE_AGENT_STORE`` is ``False``: there is no torchrun store, so rank 0
    of ``init_process_group("env://")`` hosts the store on ``MASTER_PORT`` itself.
    ``TORCHELASTIC_ERROR_FILE`` is not set: nobody would read it (``@record`` then only logs).
    """
    if not master_addr:
        raise ValueError(f"master_addr {master_addr!r} is empty; give this node's address")
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master_port {master_port!r} is not a TCP port (1..65535)")
    local_rank = rank - assignment.rank_offset
    if not 0 <= local_rank < assignment.nproc_per_node:
        raise ValueError(f"rank {rank} is not on this node (ranks {assignment.rank_offset}.."
                         f"{assignment.rank_offset + assignment.nproc_per_node - 1})")
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(assignment.node_rank), "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(assignment.world_size), "LOCAL_WORLD_SIZE": str(assignment.nproc_per_node),
        "GROUP_WORLD_SIZE": str(assignment.nnodes), "ROLE_WORLD_SIZE": str(assignment.world_size),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(int(master_port)),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",  # what torchrun reports without --rdzv-id, as ours runs it
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }


def build_direct_command(assignment: wire.LaunchAssignment, *, python: str = sys.executable
                         ) -> tuple[list[str], bool]:
    """``(argv, hosted)`` of a direct launch (pure): a hosted script or module as
    ``python -m torchrelay.agent.worker --no-supervisor ...`` (``hosted`` True, the exit hook
    in the process), any other entrypoint as the program itself."""
    argv = worker_argv(assignment.entrypoint, python)
    if argv[0] == "--exec":
        return argv[1:], False
    return [python, "-m", WORKER_MODULE, "--no-supervisor", *argv], True


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS says is free on ``host`` right now (bind port 0, read it, release)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def describe_rank(exit_: wire.RankExit) -> str:
    """Short human form: 'rank 1: exit code 3', 'rank 0: signal 9 (SIGKILL)'."""
    if exit_.returned:
        how = "returned"
        if exit_.signal is not None:
            how += f" (then signal {exit_.signal} during shutdown)"
    elif exit_.signal is not None:
        how = f"signal {exit_.signal} ({_signal_name(exit_.signal)})"
    elif exit_.exit_code is not None:
        how = f"exit code {exit_.exit_code}"
    else:
        how = "no exit record (never started or killed with its supervisor)"
    return f"rank {exit_.rank}: {how}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def classify_exit(ranks: Sequence[int], markers: Mapping[int, dict],
                  last_lines: Mapping[int, Sequence[str]]) -> tuple[list[wire.RankExit], bool]:
    """Per-rank exits and whether the launch succeeded (pure).

    ``markers`` maps a global rank to its worker marker (see ``torchrelay.agent.worker``);
    a missing one means the rank never ended through the hook. Succeeded = every rank's
    script returned. Order: failed ranks first, earliest failure first (the root cause
    before the ranks torn down because of it), then the others by rank.
    """
    exits = []
    for rank in ranks:
        marker = markers.get(rank) or {}
        exits.append((marker.get("ended_at"), wire.RankExit(
            rank=rank,
            exit_code=marker.get("exit_code"),
            signal=marker.get("signal"),
            returned=bool(marker.get("returned")),
            last_lines=list(last_lines.get(rank, ()))[-LAST_LINES:],
        )))
    failed = [(t, e) for t, e in exits if not e.returned]
    failed.sort(key=lambda pair: (pair[0] is None, pair[0] or 0.0, pair[1].rank))
    others = [e for _, e in exits if e.returned]
    return [e for _, e in failed] + others, bool(exits) and not failed


# ---------------------------------------------------------------- tailing files


class LineTailer:
    """Complete lines appended to a file since the last read (the file may not exist yet)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self, final: bool = False) -> list[str]:
        """New complete lines; with ``final`` also the unterminated rest. Never raises on I/O."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            data = b""
        self._offset += len(data)
        data = self._partial + data
        pieces = data.split(b"\n")
        self._partial = pieces.pop()
        while len(self._partial) > MAX_LINE_BYTES:
            pieces.append(self._partial[:MAX_LINE_BYTES])
            self._partial = self._partial[MAX_LINE_BYTES:]
        if final and self._partial:
            pieces.append(self._partial)
            self._partial = b""
        return [p.rstrip(b"\r").decode("utf-8", errors="replace") for p in pieces]


def split_tagged_line(line: str) -> tuple[str, str]:
    """``("stdout" | "stderr", text)`` of one line of a rank's log (``o ``/``e `` prefix)."""
    if line.startswith("e "):
        return "stderr", line[2:]
    if line.startswith("o "):
        return "stdout", line[2:]
    return "stdout", line


def parse_metric_line(line: str, *, rank: int, seq: int) -> wire.MetricRecord | None:
    """A ``MetricRecord`` from one JSON line ``{"step", "time", "values"}``; None if malformed."""
    try:
        data = json.loads(line)
        return wire.MetricRecord(rank=rank, seq=seq, step=int(data["step"]),
                                 time=float(data["time"]),
                                 values={str(k): float(v) for k, v in data["values"].items()})
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


# ---------------------------------------------------------------- processes


def find_launch_processes(launch_id: str, launch_dir: str | os.PathLike | None = None) -> list[int]:
    """Pids of live processes whose environment has ``RELAY_LAUNCH_ID=<launch_id>`` and, when
    ``launch_dir`` is given, ``RELAY_LAUNCH_DIR=<its absolute path>``.

    Give ``launch_dir`` whenever signalling what is found: launch ids repeat across clusters
    on one machine (every cluster's first job has ``job-1-a1-n0``), a launch's folder does not.
    Reads ``/proc/*/environ`` (own processes only are readable); zombies have none.
    """
    needles = [f"\0RELAY_LAUNCH_ID={launch_id}\0".encode()]
    if launch_dir is not None:
        needles.append(f"\0RELAY_LAUNCH_DIR={os.path.abspath(launch_dir)}\0".encode())
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        # os.open/os.read, not open(): this runs after every launch over every process of
        # the machine, and the buffered file object costs several times more per file
        try:
            fd = os.open(f"/proc/{entry}/environ", os.O_RDONLY)
        except OSError:
            continue
        try:
            chunks = [b"\0"]
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        except OSError:
            continue
        finally:
            os.close(fd)
        chunks.append(b"\0")  # entries end with NUL, unless a process rewrote its own
        environ = b"".join(chunks)
        if all(needle in environ for needle in needles):
            found.append(int(entry))
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_pids(pids: Sequence[int], sig: int) -> None:
    """Signal each pid (a negative one: that process group)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------- the launch


class Launch:
    """One launch: ``start`` it, ``take_logs``/``take_metrics`` while it runs,
    ``poll``/``wait`` for its ``wire.LaunchStatus``, ``stop`` it.

    ``code_dir`` is the unpacked bundle (the workers' working directory); ``run_dir`` holds
    logs, metrics and markers (created here). ``direct`` (see ``is_direct``) tells how it starts.
    """

    def __init__(self, assignment: wire.LaunchAssignment, *, code_dir: Path, run_dir: Path,
                 relay_address: str = "", python: str = sys.executable,
                 base_env: Mapping[str, str] | None = None, zygote: Zygote | None = None,
                 cuda_visible_devices: str | None = None):
        self.assignment = assignment
        self.cuda_visible_devices = cuda_visible_devices
        self.zygote = zygote
        self.code_dir = Path(code_dir)
        self.run_dir = Path(run_dir)
        self.relay_address = relay_address
        self.python = python
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.direct = is_direct(assignment)
        self.ranks = range(assignment.rank_offset, assignment.rank_offset + assignment.nproc_per_node)
        self._proc: subprocess.Popen | None = None  # torchrun, or a direct worker started as a process
        self._pid: int | None = None  # the launch's first process (torchrun or the direct worker)
        self.forked = False  # a direct worker forked by the zygote
        self._started = False
        self._lock = threading.RLock()
        self._stopped = False
        self._status: wire.LaunchStatus | None = None
        # direct: set by the supervising thread once the worker is reaped and its marker written
        self._exited = threading.Event()
        self._returncode: int | None = None
        self._log_tailers = {rank: LineTailer(self.run_dir / "logs" / f"rank-{rank}.log")
                             for rank in self.ranks}
        self._log_seq = {(rank, stream): 0 for rank in self.ranks for stream in ("stdout", "stderr")}
        self._metric_tailers = {rank: LineTailer(self.run_dir / "metrics" / f"rank-{rank}.jsonl")
                                for rank in self.ranks}
        self._metric_seq = {rank: 0 for rank in self.ranks}
        self._last_lines = {rank: collections.deque(maxlen=LAST_LINES) for rank in self.ranks}
        self._pending_logs: list[wire.LogRecord] = []
        self._pending_metrics: list[wire.MetricRecord] = []

    @property
    def launch_id(self) -> str:
        return self.assignment.launch_id

    @property
    def started(self) -> bool:
        return self._started

    @property
    def pid(self) -> int | None:
        """The launch's first process: torchrun, or the direct worker (None before start)."""
        return self._pid

    @property
    def torchrun_pid(self) -> int | None:
        return None if self.direct else self.pid

    @property
    def launcher_log(self) -> Path:
        return self.run_dir / ("launch.log" if self.direct else "torchrun.log")

    def command(self, master_addr: str, master_port: int) -> list[str]:
        if self.direct:
            return build_direct_command(self.assignment, python=self.python)[0]
        return build_torchrun_command(self.assignment, master_addr=master_addr,
                                      master_port=master_port, python=self.python)

    def start(self, master_addr: str, master_port: int) -> None:
        """Start the launch in a new session; does not block. Raises ``RuntimeError`` if
        already started or stopped, ``ValueError`` on a bad address or port, ``OSError`` if
        torchrun cannot be started (a direct worker that cannot be started is a failed rank,
        exit code 127, as under the supervisor)."""
        with self._lock:
            if self._started or self._stopped:
                raise RuntimeError(f"launch {self.launch_id} was already started or stopped")
            for sub in ("logs", "metrics", "status"):
                (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
            env = build_worker_env(self.assignment, base_env=self.base_env, run_dir=self.run_dir,
                                   relay_address=self.relay_address, cuda_visible_devices=self.cuda_visible_devices)
            if self.direct:
                self._start_direct(env, master_addr, master_port)
                return
            cmd = self.command(master_addr, master_port)
            with open(self.launcher_log, "ab") as out:
                out.write(f"$ {shlex.join(cmd)}\n".encode())
                out.flush()
                self._proc = subprocess.Popen(cmd, cwd=self.code_dir, env=env, stdin=subprocess.DEVNULL,
                                              stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True)
            self._pid = self._proc.pid
            self._started = True

    def _start_direct(self, env: dict[str, str], master_addr: str, master_port: int) -> None:
        rank = self.assignment.rank_offset
        env.update(build_rank_env(self.assignment, master_addr=master_addr, master_port=master_port,
                                  rank=rank))
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # as torchrun: the caller's, else 1
        argv, hosted = build_direct_command(self.assignment, python=self.python)
        marker = str(self.run_dir / "status" / f"rank-{rank}.json")
        try:
            os.remove(marker)  # a marker left by an earlier run must not speak for this one
        except FileNotFoundError:
            pass
        rank_log = worker.RankLog(str(self.run_dir / "logs" / f"rank-{rank}.log"))
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        exec_mode, reap, proc, pid = not hosted, worker._waitpid, None, None
        with open(self.launcher_log, "ab") as out:
            try:
                fork = self.zygote and eligible(argv, env, python=self.python, zygote_env=self.zygote.env)
                if fork:
                    try:
                        pid = self.zygote.spawn(*fork, env=env, cwd=str(self.code_dir), stdout=out_write,
                                                stderr=err_write)
                        out.write(f"$ {shlex.join(argv)}  # forked by the zygote, pid {pid}\n".encode())
                        exec_mode, reap, self.forked = fork[0] == "code", self.zygote.wait_status, True
                    except ZygoteError as exc:
                        log.warning("launch %s: zygote refused (%s); starting the worker instead",
                                    self.launch_id, exc)
                if pid is None:
                    out.write(f"$ {shlex.join(argv)}\n".encode())
                    proc = subprocess.Popen(argv, cwd=self.code_dir, env=env, stdin=subprocess.DEVNULL,
                                            stdout=out_write, stderr=err_write, start_new_session=True)
                    pid = proc.pid
            except OSError as exc:
                os.close(out_read)
                os.close(err_read)
                out.write(f"cannot start: {exc}\n".encode())
                rank_log.note(f"torchrelay worker: cannot start {argv[0]!r}: {exc}")
                rank_log.close()
                final = worker.final_marker(None, 127, None, exec_mode=exec_mode)
                worker.write_marker({**final, "pid": None, "ended_at": time.time()}, marker)
                self._started = True
                self._returncode = 127
                self._exited.set()
                return
            finally:
                os.close(out_write)
                os.close(err_write)
        self._proc, self._pid = proc, pid
        self._started = True
        threading.Thread(target=self._supervise_direct, name=f"relay-supervise-{self.launch_id}",
                         args=(pid, proc, {out_read: "o", err_read: "e"}, rank_log, marker, exec_mode, reap),
                         daemon=True).start()

    def _supervise_direct(self, pid: int, proc: subprocess.Popen | None, streams: dict[int, str],
                          rank_log: worker.RankLog, marker: str, exec_mode: bool, reap) -> None:
        """The worker supervisor's job for a direct launch (see ``torchrelay.agent.worker``):
        copy output, reap (``reap(pid, block)``: waitpid, or the zygote's report), write the
        final marker; then say the launch exited."""
        try:
            try:
                status = worker.pump_until_exit(pid, streams, rank_log, reap)
            except OSError:
                log.exception("launch %s: copying the worker's output failed", self.launch_id)
                for fd in streams:  # whatever is still open: the worker gets EPIPE, not a hang
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                status = reap(pid, True)
            self._returncode = os.waitstatus_to_exitcode(status)
            if proc is not None:
                proc.returncode = self._returncode  # reaped here, not by Popen
            worker.conclude(pid, status, exec_mode=exec_mode, path=marker, rank_log=rank_log,
                            rank=self.assignment.rank_offset)
        except Exception:  # noqa: BLE001 - the launch must still end; poll reports no record
            log.exception("launch %s: supervising the worker failed", self.launch_id)
        finally:
            self._exited.set()

    # -------------------------------------------------------------- logs and metrics

    def _read_files(self, final: bool) -> None:
        for rank, tailer in self._log_tailers.items():
            for line in tailer.read(final=final):
                stream, text = split_tagged_line(line)
                self._pending_logs.append(wire.LogRecord(
                    rank=rank, attempt=self.assignment.attempt, stream=stream,
                    seq=self._log_seq[(rank, stream)], text=text))
                self._log_seq[(rank, stream)] += 1
                self._last_lines[rank].append(text)
        for rank, tailer in self._metric_tailers.items():
            for line in tailer.read(final=final):
                seq = self._metric_seq[rank]
                self._metric_seq[rank] += 1
                record = parse_metric_line(line, rank=rank, seq=seq)
                if record is None:
                    log.warning("launch %s rank %d: metrics line %d is not "
                                '{"step": int, "time": float, "values": {...}}: %.200s',
                                self.launch_id, rank, seq, line)
                else:
                    self._pending_metrics.append(record)

    def take_logs(self) -> list[wire.LogRecord]:
        """Log records written since the last call (thread-safe, does not block)."""
        with self._lock:
            self._read_files(final=self._status is not None)
            records, self._pending_logs = self._pending_logs, []
            return records

    def take_metrics(self) -> list[wire.MetricRecord]:
        """Metric records written since the last call (thread-safe, does not block)."""
        with self._lock:
            self._read_files(final=self._status is not None)
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

    def _finish(self, returncode: int | None) -> wire.LaunchStatus:
        self._read_files(final=True)
        ranks, succeeded = classify_exit(self.ranks, self._markers(), self._last_lines)
        if succeeded:
            message = f"all {len(ranks)} ranks returned"
        elif not self._started:
            message = "stopped before torchrun started" if not self.direct else "stopped before it started"
        else:
            failures = [describe_rank(r) for r in ranks if not r.returned]
            message = "; ".join(failures[:4])
            if self._stopped:
                message = "stopped: " + message
            if all(r.exit_code is None and r.signal is None for r in ranks):
                what = "the worker" if self.direct else "torchrun"
                message += f"; {what} exited with {returncode}: " + " | ".join(self._launcher_tail(8))
        return wire.LaunchStatus(state="exited", ranks=ranks, succeeded=succeeded,
                                 stopped=self._stopped, message=message)

    def _has_exited(self) -> tuple[bool, int | None]:
        """(whether the launch's first process has ended, its return code); does not block."""
        if self.direct:
            return self._exited.is_set(), self._returncode
        assert self._proc is not None
        returncode = self._proc.poll()
        return returncode is not None, returncode

    def poll(self) -> wire.LaunchStatus | None:
        """The final status once the launch has exited, else None (does not block)."""
        with self._lock:
            if self._status is not None:
                return self._status
            if not self._started:
                if self._stopped:
                    self._status = self._finish(None)
                return self._status
            exited, returncode = self._has_exited()
            if not exited:
                return None
            # torchrun waits for its workers unless it died itself, and a worker's children may
            # outlive it (torchrun ends its workers' process groups): end what is left
            self._kill_leftovers(grace_s=2.0)
            self._status = self._finish(returncode)
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
            if not self._started:
                time.sleep(step)
            elif self.direct:
                self._exited.wait(step)
            else:
                try:
                    self._proc.wait(timeout=step)
                except subprocess.TimeoutExpired:
                    pass

    def remaining_processes(self) -> list[int]:
        """Live pids of this launch (torchrun, supervisors, scripts and their children)."""
        pids = set(find_launch_processes(self.launch_id, self.run_dir))
        if self._started and self._pid is not None and not self._has_exited()[0]:
            pids.add(self._pid)
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
            proc, pid = self._proc, self._pid
        grace_s = max(grace_s, 0.0)
        deadline = time.monotonic() + grace_s
        if pid is not None and self.direct:
            # the worker's own group: the script and the children it did not move elsewhere
            _signal_group(pid, signal.SIGTERM)
            if not self._exited.wait(grace_s):
                _signal_group(pid, signal.SIGKILL)
                self._exited.wait()
        elif proc is not None:
            # torchrun forwards SIGTERM to each worker's session and waits for them.
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        self._kill_leftovers(max(0.0, deadline - time.monotonic()))
        status = self.poll()
        assert status is not None
        return status

    def _kill_leftovers(self, grace_s: float) -> None:
        """SIGTERM processes still tagged with this launch (and, for a direct launch, still in
        its worker's process group: a forked worker's own children carry the zygote's
        environment, not the launch's), SIGKILL them after ``grace_s``."""
        group = self._pid if self.direct and self._pid is not None else None

        def left() -> list[int]:
            pids = find_launch_processes(self.launch_id, self.run_dir)
            if group is not None and _group_alive(group):
                pids.append(-group)
            return pids

        remaining = left()
        if not remaining:
            return
        _signal_pids(remaining, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while remaining:
            if time.monotonic() >= deadline:
                _signal_pids(remaining, signal.SIGKILL)
            time.sleep(0.05)
            remaining = left()
