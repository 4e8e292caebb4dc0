"""Worker exit hook: run a user's script unchanged, and end the process before teardown can abort.

Usage (what the launcher puts after torchrun's ``-m``)::

    python -m torchrelay.agent.worker SCRIPT.py ARGS...      # like `python SCRIPT.py ARGS...`
    python -m torchrelay.agent.worker -m MODULE ARGS...      # like `python -m MODULE ARGS...`
    python -m torchrelay.agent.worker --exec PROGRAM ARGS... # any other program (no hook)
    python -m torchrelay.agent.worker --no-supervisor SCRIPT.py|-m MODULE ARGS...
        # the script process alone: its parent (the agent's direct launch) supervises it

Why: with torch's gloo backend a rank sometimes dies with SIGABRT ("terminate called without
an active exception") during interpreter teardown, after the script has returned
(docs/design.md, "Exit-time abort with DDP on gloo"). torchrun then calls a finished job failed. This module makes "the script returned"
the definition of success, for scripts that know nothing about torchrelay.

How, in two layers:

1. A small **supervisor** (this process; stdlib only, torch is never imported here) forks the
   **script process**, forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 to it and reaps it.
2. The script process runs the script with ``runpy`` as ``__main__`` (``sys.argv`` and
   ``sys.path[0]`` as ``python SCRIPT.py`` / ``python -m MODULE`` would set them). When the
   script returns (or raises ``SystemExit`` with 0/None) it records ``returned`` in the rank
   marker, then does what interpreter shutdown would do that users rely on: waits for
   non-daemon threads, runs the atexit handlers (then ``MPI_Finalize`` if the script used
   mpi4py: it is otherwise left to teardown), flushes stdio, ``gc.collect()`` (DDP's reducer
   sits in a reference cycle; collecting it while everything is still alive is what keeps
   gloo quiet), and ends with ``os._exit(0)``, so the teardown where gloo aborts never runs.
   If something still aborts during those steps, the supervisor sees a signal *after* the
   marker said ``returned`` and exits 0 for the rank: a rank whose script returned succeeds.
   A script that raises, or exits non-zero, prints its traceback and exits with its code
   (1 for an exception); a script process killed by a signal before returning makes the
   supervisor exit ``128 + signal``; both are failures.

``--no-supervisor`` (what the agent's direct launch of a world of one uses, see
``torchrelay.agent.backends``) runs only layer 2 in this process; the parent that started it
does layer 1 with the same functions (``pump_until_exit``, ``conclude``), which saves starting
a second interpreter per launch.

Rank marker ``$RELAY_RANK_STATUS_DIR/rank-$RANK.json`` (only when that variable is set):
written by the script process as ``{"returned": bool, "exit_code": int}`` when the script
ends, then rewritten by the supervisor, once the script process is reaped, as
``{"returned": bool, "exit_code": int|null, "signal": int|null, "final": true,
"script_exit_code": int|null, "pid": int, "ended_at": float}`` where ``exit_code`` and
``signal`` describe how the script process really ended (``signal`` set when it was killed,
e.g. 6 for an abort during teardown). In ``--exec`` mode ``returned`` means "exited 0". Markers are written atomically
(temporary file + rename).

Output: when ``$RELAY_LOG_DIR`` is set, the script's stdout and stderr are pipes the supervisor
reads; it appends them, line by line in the order it read them, to one file
``$RELAY_LOG_DIR/rank-$RANK.log`` where each line starts with ``o `` (stdout) or ``e ``
(stderr). One file keeps a traceback after the lines printed before it, which two files could
not. Lines longer than 64 KiB are cut into pieces. Without ``$RELAY_LOG_DIR`` the script
inherits the supervisor's stdout and stderr.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import sys
import threading
import time

from torchrelay.agent.target import TargetKind, UsageError, WorkerTarget, target_of_worker_argv

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)


def exit_code_of(exc: SystemExit) -> int:
    """The process exit code Python would use for an uncaught ``SystemExit``."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF  # as the OS reports it: sys.exit(-1) is 255
    return 1  # a message: Python prints it and exits 1


def decode_wait_status(status: int) -> tuple[int | None, int | None]:
    """``(exit_code, signal)`` from an ``os.waitpid`` status; exactly one is set."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status), None


def final_marker(script_marker: dict | None, exit_code: int | None, sig: int | None,
                 *, exec_mode: bool) -> dict:
    """The supervisor's verdict for one rank (pure).

    ``script_marker`` is what the script process wrote (None if it never did: killed or
    crashed before its script ended); ``exit_code``/``sig`` is how the process really ended.
    """
    if exec_mode:
        returned = exit_code == 0
        script_code = exit_code
    else:
        returned = bool(script_marker and script_marker.get("returned"))
        script_code = script_marker.get("exit_code") if script_marker else None
    return {"returned": returned, "exit_code": exit_code, "signal": sig, "final": True,
            "script_exit_code": script_code}


def supervisor_exit_code(marker: dict) -> int:
    """What the supervisor exits with: 0 for a returned script, else the failure's code."""
    if marker["returned"]:
        return 0
    if marker["signal"] is not None:
        return 128 + marker["signal"]
    code = marker["exit_code"]
    return code if code else 1


# ---------------------------------------------------------------- markers and output


def marker_path(env=os.environ) -> str | None:
    """``$RELAY_RANK_STATUS_DIR/rank-$RANK.json`` of ``env``, or None without that variable."""
    directory = env.get("RELAY_RANK_STATUS_DIR")
    if not directory:
        return None
    return os.path.join(directory, f"rank-{env.get('RANK', '0')}.json")


def write_marker(data: dict, path: str | None = None) -> None:
    """Atomically write the rank marker to ``path`` (default: ``marker_path()``; nothing
    without one). Never raises."""
    path = path or marker_path()
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError as exc:  # a marker we cannot write must not change the rank's outcome
        print(f"torchrelay worker: cannot write rank marker {path}: {exc}", file=sys.stderr)


def read_marker(path: str | None = None) -> dict | None:
    path = path or marker_path()
    if path is None:
        return None
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


MAX_LINE_BYTES = 64 * 1024


def log_path(env=os.environ) -> str | None:
    """``$RELAY_LOG_DIR/rank-$RANK.log`` of ``env`` (the folder is created), or None."""
    directory = env.get("RELAY_LOG_DIR")
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"rank-{env.get('RANK', '0')}.log")


class RankLog:
    """Appends tagged lines (``o `` stdout, ``e `` stderr) to a rank's log file."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.partial = {"o": b"", "e": b""}

    def feed(self, tag: str, data: bytes) -> None:
        """Write the complete lines in ``partial + data``; keep the unterminated rest.

        The other stream's unterminated rest is written first, as its own line: output
        stays in the order it was read, as a terminal would show it.
        """
        for other in self.partial:
            if other != tag:
                self.end(other)
        lines = (self.partial[tag] + data).split(b"\n")
        rest = lines.pop()
        while len(rest) > MAX_LINE_BYTES:
            lines.append(rest[:MAX_LINE_BYTES])
            rest = rest[MAX_LINE_BYTES:]
        self.partial[tag] = rest
        self._write(tag, lines)

    def end(self, tag: str) -> None:
        """The stream ended: write its unterminated rest, if any."""
        if self.partial[tag]:
            self._write(tag, [self.partial[tag]])
            self.partial[tag] = b""

    def note(self, text: str) -> None:
        self._write("e", [text.encode()])

    def _write(self, tag: str, lines: list[bytes]) -> None:
        if lines:
            prefix = tag.encode() + b" "
            os.write(self.fd, b"".join(prefix + line + b"\n" for line in lines))

    def close(self) -> None:
        for tag in self.partial:
            self.end(tag)
        os.close(self.fd)


def waitpid_status(child: int, block: bool) -> int | None:
    """``os.waitpid``'s status of ``child`` once it ended; None while it runs and ``block`` is false."""
    pid, status = os.waitpid(child, 0 if block else os.WNOHANG)
    return status if pid else None


def pump_until_exit(child: int, streams: dict[int, str], rank_log: RankLog, reap=waitpid_status) -> int:
    """Copy the child's output pipes (``{read fd: "o" | "e"}``, closed here) into ``rank_log``
    until it exits; returns its wait status. Blocks.

    ``reap(child, block)`` gives the wait status once the child ended (None while it runs and
    ``block`` is false); by default ``os.waitpid``, so the child is reaped here.
    After the child ended, output still arriving (from a grandchild holding the pipe) is read
    for at most one more second.
    """
    status = None
    reaped_at = 0.0
    while streams:
        if status is None:
            wait_status = reap(child, False)
            if wait_status is not None:
                status, reaped_at = wait_status, time.monotonic()
        elif time.monotonic() - reaped_at > 1.0:
            break
        ready, _, _ = select.select(list(streams), [], [], 0.2)
        for fd in ready:
            data = os.read(fd, 65536)
            if data:
                rank_log.feed(streams[fd], data)
            else:
                rank_log.end(streams.pop(fd))
                os.close(fd)
    for fd in streams:
        os.close(fd)
    if status is None:  # it closed its stdout and stderr but lives on
        status = reap(child, True)
    return status


# ---------------------------------------------------------------- the script process


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the supervisor dies (best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _user_traceback(exc: BaseException):
    """The traceback without the frames of this module and runpy (what `python x.py` shows)."""
    import runpy

    hidden = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename not in hidden and os.path.abspath(filename) not in hidden:
            break
        tb = tb.tb_next
    return tb


def _finalize_mpi() -> None:
    """``MPI_Finalize`` for a script that used mpi4py and returned: mpi4py registers it where
    only interpreter teardown runs it (``Py_AtExit``), which ``os._exit`` skips, and Open MPI
    calls a rank that ends without it a failure and aborts the job. Not after a failure: it
    can wait for ranks that will never come, and Open MPI ends the job on that exit anyway."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def _finish(code: int, keep_alive: object = None) -> None:
    """Shutdown without interpreter teardown: threads, atexit, flush, gc, ``os._exit``.

    ``keep_alive`` (the script's globals) is only held so that nothing in it is finalised.
    """
    try:
        shutdown_threads = getattr(threading, "_shutdown", None)
        if shutdown_threads is not None:  # waits for non-daemon threads, as Py_Finalize does
            shutdown_threads()
        atexit._run_exitfuncs()
        if code == 0:
            _finalize_mpi()
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        gc.collect()
        os._exit(code)


def run_script(worker_target: WorkerTarget) -> None:
    """Run the user's script or module (a hosted target) as ``__main__`` in this process;
    never returns."""
    import runpy

    script, target = worker_target.kind is TargetKind.SCRIPT, worker_target.target
    sys.argv = [target, *worker_target.args]  # run_module replaces argv[0] with the module's file
    if script:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    # The script's globals stay referenced until os._exit, as they would under `python x.py`:
    # runpy drops its temporary __main__ on return, and freeing a DDP model or a process
    # group there is just the kind of finalisation that can abort.
    script_globals = None
    try:
        if script:
            script_globals = runpy.run_path(target, run_name="__main__")
        else:
            script_globals = runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exit_code_of(exc)
        if code != 0 and exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        write_marker({"returned": code == 0, "exit_code": code})
        _finish(code)
    except BaseException as exc:  # noqa: BLE001 - any other escape is the script failing
        import traceback  # only on failure: the import costs every launch otherwise

        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        write_marker({"returned": False, "exit_code": code})
        traceback.print_exception(type(exc), exc, _user_traceback(exc), file=sys.stderr)
        _finish(code)
    # Recorded before the shutdown steps: an abort inside them happens after the script returned.
    write_marker({"returned": True, "exit_code": 0})
    _finish(0, keep_alive=script_globals)


def run_code(code: str, args: list[str], hidden_files: tuple[str, ...] = ()) -> None:
    """Run ``code`` as ``python -c CODE ARGS...`` would, in this process; never returns.

    For a process forked from a warm interpreter (``torchrelay.agent.zygote``): the code runs
    in a fresh ``__main__``; an exception prints its traceback (without the frames of this
    module and of ``hidden_files``) and exits 1, ``SystemExit`` exits with its code; then the
    same shutdown as a hosted script (threads, atexit, flush, gc, ``os._exit``). No marker is
    written: a program's verdict is its exit code.
    """
    import builtins
    import types

    sys.argv = ["-c", *args]
    sys.path[0] = ""  # as `python -c` sets it: the current directory
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as exc:
        code_ = exit_code_of(exc)
        if code_ != 0 and exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        _finish(code_)
    except BaseException as exc:  # noqa: BLE001 - any other escape is the program failing
        import traceback

        tb = exc.__traceback__
        hidden = {os.path.abspath(__file__), *map(os.path.abspath, hidden_files)}
        while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in hidden:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
        _finish(130 if isinstance(exc, KeyboardInterrupt) else 1)
    _finish(0, keep_alive=main)


# ---------------------------------------------------------------- the supervisor


def supervise(target: WorkerTarget) -> int:
    """Fork the script process, forward signals, copy its output, reap it, write the final
    marker. Returns the supervisor's exit code (``supervisor_exit_code``)."""
    path = marker_path()
    if path is not None:
        try:
            os.remove(path)  # a marker left by an earlier run must not speak for this one
        except FileNotFoundError:
            pass
    rank_log_path = log_path()
    pipes = (os.pipe(), os.pipe()) if rank_log_path else ()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        try:
            _die_with_parent()
            for (read_end, write_end), fd in zip(pipes, (1, 2)):
                os.dup2(write_end, fd)
                os.close(read_end)
                os.close(write_end)
            if not target.hosted:
                argv = target.program_argv()
                os.execvp(argv[0], argv)
            run_script(target)
        except BaseException as exc:  # noqa: BLE001 - e.g. exec of a missing program
            print(f"torchrelay worker: cannot start {target.target!r}: {exc}", file=sys.stderr)
            sys.stderr.flush()
        os._exit(127)

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    rank_log = RankLog(rank_log_path) if rank_log_path else None
    if rank_log is not None:
        for _, write_end in pipes:
            os.close(write_end)
        status = pump_until_exit(child, {pipes[0][0]: "o", pipes[1][0]: "e"}, rank_log)
    else:
        _, status = os.waitpid(child, 0)
    marker = conclude(child, status, exec_mode=not target.hosted, path=path, rank_log=rank_log,
                      rank=os.environ.get("RANK", "?"))
    return supervisor_exit_code(marker)


def conclude(child: int, status: int, *, exec_mode: bool, path: str | None,
             rank_log: RankLog | None, rank: object) -> dict:
    """The supervisor's last step for a reaped script process: its final marker (from the
    script's own marker at ``path`` and the wait ``status``), a note in the log when it died
    after returning, the log closed (every line is in the file before the marker says the
    rank ended), the marker written. Returns the marker. Never raises on I/O."""
    exit_code, sig = decode_wait_status(status)
    marker = final_marker(read_marker(path), exit_code, sig, exec_mode=exec_mode)
    marker["pid"] = child
    marker["ended_at"] = time.time()
    if marker["returned"] and sig is not None:
        note = (f"torchrelay worker: rank {rank} script returned; "
                f"process then died of signal {sig} during shutdown; counted as success")
        if rank_log is not None:
            rank_log.note(note)
        else:
            print(note, file=sys.stderr)
    if rank_log is not None:
        rank_log.close()
    write_marker(marker, path)
    return marker


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    unsupervised = bool(argv) and argv[0] == "--no-supervisor"
    try:
        target = target_of_worker_argv(argv[1:] if unsupervised else argv)
        if unsupervised and not target.hosted:
            raise UsageError("--no-supervisor runs a script or a module; the parent execs a program itself")
    except UsageError as exc:
        print(f"torchrelay worker: {exc}", file=sys.stderr)
        return 2
    if unsupervised:
        run_script(target)  # never returns
    return supervise(target)


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())  # the supervisor never imported torch; skip teardown all the same
