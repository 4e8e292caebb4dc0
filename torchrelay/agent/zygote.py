"""A warm interpreter that forks the agent's direct Python workers, instead of starting each.

Why: a no-op job is mostly interpreter start-up. ``python -c pass`` in this environment costs
about 25 ms of CPU (``site`` and the editable-install finder), the whole of what the platform
may spend per job to finish 50 no-op jobs a second on two cores. A fork of an interpreter
that already did that costs about 1.5 ms. This is what Android's zygote and
``multiprocessing``'s forkserver do; neither fits as is (the forkserver runs a function of
the parent's, not a program with its own environment, working directory, session and
output pipes, and tells nobody how the child ended), hence this small one.

Contract:
- ``Zygote(python, env, log_path)`` does nothing until ``spawn``; the first ``spawn`` starts
  ``python -m torchrelay.agent.zygote FD`` in a new session with ``env`` (restarted if it died).
- ``Zygote.spawn(target, env=, cwd=, stdout=, stderr=) -> pid`` (blocks until forked; raises
  ``ZygoteError``): the child starts a new session (its pid is its process group), gets
  ``env`` as ``os.environ``, ``cwd``, stdin from /dev/null and the two given descriptors as
  stdout and stderr, then runs the ``target.WorkerTarget``: code (``python -c CODE ARGS``,
  see ``worker.run_code``), or a script or module (``worker.run_script``, the exit hook).
- ``Zygote.wait_status(pid, block)`` is the child's wait status once it ended (the zygote
  reaps it and reports it); None while it runs (``block`` false). If the zygote dies, its
  children are killed and reported as SIGKILLed.
- ``eligible(target, env, python=, zygote_python=, zygote_env=)`` (pure) says whether a
  direct launch may be forked here instead of started: only code, hosted scripts and modules
  (no other program), only when the interpreter that would run it (``python``; for code its
  own ``interpreter``) is the zygote's, and only when every variable the interpreter reads at
  start-up (``PYTHON*``, ``LANG``, ``LC_*``, ``TZ``) is the same as the zygote's.
- What differs from a fresh interpreter, and why it is acceptable: the hash seed is the
  zygote's (``PYTHONHASHSEED`` equal is required, so a job that pins it gets its value);
  modules the zygote imported (the standard library's, ``torchrelay.agent.worker``) are
  already in ``sys.modules``; ``/proc/PID/environ`` of the child itself shows the zygote's
  start environment, so the agent tracks it by pid and process group (its children, which
  exec, carry the job's). ``random`` reseeds itself after fork.
- The zygote exits when the agent's end of its socket closes (the agent died or closed it),
  and kills the sessions of the children still running first: nothing it forked outlives
  the agent.
- ``Zygote(preload=("torch",))`` is a *warm* zygote (the agent's for multi-rank launches, see
  ``torchrelay.agent.warm``): it imports those modules once before it serves, so a forked rank
  skips ``import torch`` (about 1.5 s of CPU). Because the libraries it loaded read their
  threading and compiler variables when loaded, ``refusal`` then also requires ``OMP_*``,
  ``MKL_*``, ``OPENBLAS_*``, ``KMP_*``, ``GOMP_*``, ``TORCHDYNAMO_*``, ``TORCHINDUCTOR_*``,
  ``TORCH_COMPILE*``, ``TORCH_LOGS`` and ``TORCH_CPP_LOG_LEVEL`` to equal the zygote's
  (``THREAD_PREFIXES``). Besides torch it imports ``torch.distributed``, ``torch.nn.parallel``
  and ``torch._dynamo`` (which the first optimizer a script makes imports: seconds of CPU). It
  refuses to fork once a CUDA context exists in it (the child could not use CUDA); it never
  makes one, since it runs no job code. After the fork the child reseeds what a fresh
  interpreter seeds from entropy (torch's default CPU generator and numpy's global one, if
  loaded; ``random`` reseeds itself), so no two workers share a random stream. The zygote
  freezes what it imported (``gc.freeze``) before it serves: a worker's collections skip those
  objects instead of copying every page that holds one (``gc.get_freeze_count()`` is the one
  trace of it a worker can see).
- ``Zygote.spawn_store(host, port, stdout=, stderr=)`` forks a process that hosts a
  ``TCPStore`` on ``host:port`` (what torchrun's agent hosts for its workers) until it is
  killed; it needs a zygote that preloaded torch.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping

from torchrelay.agent import worker
from torchrelay.agent.target import TargetKind, WorkerTarget

MAX_MESSAGE = 256 * 1024  # one request: an environment and a command line
STARTUP_VARIABLES = ("LANG", "TZ")  # besides PYTHON* and LC_*: read when the interpreter starts
# read when torch, numpy and torch._dynamo/_inductor load (a warm zygote loaded them already)
THREAD_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCHDYNAMO_", "TORCHINDUCTOR_",
                   "TORCH_COMPILE", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL")
STORE_KIND = "store"  # the request kind of a TCPStore host (see ``spawn_store``)


class ZygoteError(RuntimeError):
    """The zygote could not fork the worker (it is not running, or refused the request)."""


def startup_environment(env: Mapping[str, str], threads: bool = False) -> dict[str, str]:
    """The variables of ``env`` an interpreter reads when it starts (pure); with ``threads``
    also those torch and numpy read when they load (``THREAD_PREFIXES``)."""
    prefixes = ("PYTHON", "LC_", *(THREAD_PREFIXES if threads else ()))
    return {k: v for k, v in env.items() if k.startswith(prefixes) or k in STARTUP_VARIABLES}


def refusal(target: WorkerTarget, env: Mapping[str, str], *, python: str, zygote_python: str,
            zygote_env: Mapping[str, str], threads: bool = False) -> str | None:
    """Why a launch of ``target`` with ``env`` may not be forked from the zygote, or None when
    it may (pure); ``python`` is the interpreter that would run a hosted target, ``threads``
    whether the zygote preloaded libraries that read the threading variables."""
    if target.kind is TargetKind.PROGRAM:
        return f"{target.target!r} is not a Python script, module or -c code"
    interpreter = target.interpreter if target.kind is TargetKind.CODE else python
    if interpreter != zygote_python:
        return f"the job's interpreter {interpreter!r} is not the zygote's {zygote_python!r}"
    ours, theirs = startup_environment(env, threads), startup_environment(zygote_env, threads)
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        return f"the job sets {', '.join(differ)} differently from the zygote (read when the interpreter starts)"
    return None


def eligible(target: WorkerTarget, env: Mapping[str, str], *, python: str, zygote_python: str,
             zygote_env: Mapping[str, str]) -> bool:
    """Whether a direct launch of ``target`` with ``env`` may be forked from the zygote
    (pure); ``python`` is the interpreter that would run a hosted target."""
    return refusal(target, env, python=python, zygote_python=zygote_python, zygote_env=zygote_env) is None


# ---------------------------------------------------------------- the agent's side


class Zygote:
    """The agent's handle on its zygote process. Thread-safe."""

    def __init__(self, python: str = sys.executable, env: Mapping[str, str] | None = None,
                 log_path: str | None = None, preload: tuple[str, ...] = ()):
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.log_path = log_path
        self.preload = tuple(preload)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._statuses: dict[int, int] = {}
        self._children: set[int] = set()
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _ensure_started(self) -> socket.socket:
        """Called with ``_lock`` held."""
        if self._closed:
            raise ZygoteError("the zygote was closed")
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
            try:
                self._proc = subprocess.Popen(
                    [self.python, "-m", "torchrelay.agent.zygote", str(theirs.fileno()), *self.preload],
                    env=self.env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                    stdout=log, stderr=log, start_new_session=True)
            finally:
                if log is not subprocess.DEVNULL:
                    log.close()
        except OSError as exc:
            ours.close()
            raise ZygoteError(f"cannot start the zygote ({self.python}): {exc}") from exc
        finally:
            theirs.close()
        self._sock = ours
        threading.Thread(target=self._read_replies, args=(ours, self._proc), name="relay-zygote-reader",
                         daemon=True).start()
        return ours

    @property
    def threads(self) -> bool:
        """Whether it preloaded libraries that read the threading variables when they load."""
        return bool(self.preload)

    def spawn(self, target: WorkerTarget, *, env: Mapping[str, str], cwd: str, stdout: int, stderr: int,
              timeout: float = 120.0) -> int:
        """Fork a worker that runs ``target`` (code, a script or a module); its pid. Blocks
        until forked (the first request also waits for the zygote's start and preloads).
        Raises ``ZygoteError``."""
        if target.kind is TargetKind.PROGRAM:
            raise ZygoteError(f"a program ({target.target!r}) is started, not forked")
        return self._request({"kind": target.kind.value, "target": target.target, "args": list(target.args),
                              "env": dict(env), "cwd": cwd}, stdout, stderr, timeout)

    def spawn_store(self, host: str, port: int, *, env: Mapping[str, str], cwd: str, stdout: int, stderr: int,
                    timeout: float = 120.0) -> int:
        """Fork a process that hosts a TCPStore on ``host:port`` until killed (its own session);
        its pid. Raises ``ZygoteError`` (also when the zygote did not preload torch)."""
        if "torch" not in self.preload:
            raise ZygoteError("only a zygote that preloaded torch can host a store")
        return self._request({"kind": STORE_KIND, "target": f"{host}:{int(port)}", "args": [], "env": dict(env),
                              "cwd": cwd}, stdout, stderr, timeout)

    def _request(self, request: dict, stdout: int, stderr: int, timeout: float) -> int:
        with self._lock:
            sock = self._ensure_started()
            self._next_id += 1
            request_id = self._next_id
            body = json.dumps({"id": request_id, **request}).encode()
            if len(body) > MAX_MESSAGE:
                raise ZygoteError(f"request of {len(body)} bytes is over {MAX_MESSAGE}")
            try:
                socket.send_fds(sock, [body], [stdout, stderr])
            except OSError as exc:
                raise ZygoteError(f"the zygote does not answer: {exc}") from exc
            if not self._changed.wait_for(lambda: request_id in self._replies or self._sock is not sock,
                                          timeout):
                raise ZygoteError(f"the zygote did not fork within {timeout:g} s")
            reply = self._replies.pop(request_id, None)
        if reply is None:
            raise ZygoteError("the zygote died before it forked the worker")
        if "error" in reply:
            raise ZygoteError(reply["error"])
        return int(reply["pid"])

    def wait_status(self, pid: int, block: bool) -> int | None:
        """The wait status of a forked worker once it ended (None while it runs, unless
        ``block``)."""
        with self._lock:
            if block:
                self._changed.wait_for(lambda: pid in self._statuses)
            return self._statuses.pop(pid, None) if pid in self._statuses else None

    def _read_replies(self, sock: socket.socket, proc: subprocess.Popen) -> None:
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._lock:
                if "exited" in message:
                    self._statuses[message["exited"]] = message["status"]
                    self._children.discard(message["exited"])
                else:
                    if "pid" in message:
                        self._children.add(message["pid"])
                    self._replies[message["id"]] = message
                self._changed.notify_all()
        # The zygote is gone (it kills its children when it can; make sure, and say so).
        with self._lock:
            orphans, self._children = self._children, set()
            if self._sock is sock:
                self._sock = None
            self._changed.notify_all()
        for pid in orphans:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        with self._lock:
            for pid in orphans:
                self._statuses.setdefault(pid, signal.SIGKILL)  # a wait status: killed by SIGKILL
            self._changed.notify_all()
        sock.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def close(self, timeout: float = 10.0) -> None:
        """Stop the zygote (its running children are killed). Idempotent."""
        with self._lock:
            self._closed = True
            sock, proc = self._sock, self._proc
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # EOF for the zygote: it ends
            except OSError:
                pass
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------- the zygote's side


def _child(request: dict, stdout: int, stderr: int, sock: socket.socket, wakeup: tuple[int, int]) -> None:
    """In the forked child: become the worker; never returns."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wakeup:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        for fd in {devnull, stdout, stderr} - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_after_fork()
        if request["kind"] == STORE_KIND:
            _host_store(request["target"])
        target = WorkerTarget(kind=TargetKind(request["kind"]), target=request["target"],
                              args=tuple(request["args"]))
        if target.kind is TargetKind.CODE:
            worker.run_code(target.target, list(target.args), hidden_files=(__file__,))
        if target.kind is TargetKind.MODULE:
            sys.path[0] = os.getcwd()  # as `python -m` sets it
        worker.run_script(target)
    except BaseException as exc:  # noqa: BLE001 - e.g. a working directory that is gone
        try:
            os.write(2, f"torchrelay zygote: cannot start {request.get('target')!r}: {exc}\n".encode())
        finally:
            os._exit(127)
    os._exit(127)


def _fresh_after_fork() -> None:
    """Reseed what a fresh interpreter seeds from entropy, so forked workers do not share a
    stream: torch's default CPU generator and numpy's global one (when the zygote loaded them;
    torch seeds its CPU generator non-deterministically at import). ``random`` does it itself."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _host_store(address: str) -> None:
    """In the forked child: host a TCPStore on ``address`` (``host:port``) until killed, as
    torchrun's agent does for its workers (``multi_tenant``: a worker's own ``TCPStore`` on
    the same port shares it). Never returns."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False, multi_tenant=True)
    print(f"torchrelay zygote: hosting the launch's store on {address}", flush=True)
    while store is not None:
        signal.pause()


def _fork_refusal() -> str | None:
    """Why this zygote may not fork now, or None (a CUDA context cannot cross a fork)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a CUDA context exists in the zygote; a forked child could not use CUDA"
    return None


def serve(fd: int) -> None:
    """The zygote's loop: fork on each request, report each child's end; returns when the
    agent's end closes, after killing the sessions of the children still running."""
    sock = socket.socket(fileno=fd)
    read_wakeup, write_wakeup = os.pipe()
    os.set_blocking(write_wakeup, False)
    os.set_blocking(read_wakeup, False)
    signal.set_wakeup_fd(write_wakeup)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
    children: set[int] = set()

    def send(message: dict) -> bool:
        try:
            sock.send(json.dumps(message).encode())
            return True
        except OSError:  # the agent is gone
            return False

    agent_there = True
    while agent_there:
        ready, _, _ = select.select([sock, read_wakeup], [], [])
        if read_wakeup in ready:
            try:
                os.read(read_wakeup, 4096)
            except BlockingIOError:
                pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            children.discard(pid)
            agent_there = send({"exited": pid, "status": status}) and agent_there
        if sock not in ready or not agent_there:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except OSError:
            data, fds = b"", []
        if not data:
            break
        request = json.loads(data)
        if len(fds) != 2:
            agent_there = send({"id": request.get("id"), "error": f"{len(fds)} descriptors came, 2 needed"})
            for extra in fds:
                os.close(extra)
            continue
        refused = _fork_refusal()
        try:
            if refused:
                raise OSError(refused)
            pid = os.fork()
        except OSError as exc:
            agent_there = send({"id": request["id"], "error": f"fork failed: {exc}"})
            pid = None
        if pid == 0:
            _child(request, fds[0], fds[1], sock, (read_wakeup, write_wakeup))
        for received in fds:
            os.close(received)
        if pid:
            children.add(pid)
            agent_there = send({"id": request["id"], "pid": pid})
    for pid in children:  # the agent is gone: nothing it started may outlive it
        for kill in (os.killpg, os.kill):  # its session, and itself if it had none yet
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _preload(modules: list[str]) -> None:
    """What every worker would import anyway, imported once here (besides the worker module,
    imported with this one), and the ``modules`` asked for (a warm zygote's ``torch``)."""
    import importlib
    import pkgutil  # noqa: F401  (runpy.run_path imports it, and typing with it)
    import runpy  # noqa: F401
    import types  # noqa: F401

    for name in modules:
        importlib.import_module(name)
    if "torch" in modules:  # what a DDP script imports next; none of these starts a thread
        importlib.import_module("torch.distributed")
        importlib.import_module("torch.nn.parallel")
        importlib.import_module("torch._dynamo")  # the first optimizer a script makes imports it: seconds


if __name__ == "__main__":
    _preload(sys.argv[2:])
    # Everything imported so far goes to the collector's permanent generation: a forked worker's
    # collections (the exit hook's gc.collect() among them) then never walk torch's objects,
    # which would write to every page that holds one and copy it (Python's gc.freeze docs).
    gc.freeze()
    serve(int(sys.argv[1]))
    os._exit(0)
