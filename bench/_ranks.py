"""Worker processes of a bench, owned: started in their own sessions, waited for, killed on the way out.

Contract: ``free_port()`` is a port the OS has just handed out on 127.0.0.1. ``run_owned(commands,
env, timeout_s)`` starts every command at once (each in its own session), waits for all of
them, and raises ``SystemExit`` naming the first that exited non-zero; whatever is still
running when it returns or raises (a timeout included) is killed with its process group.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Mapping, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_owned(commands: Sequence[Sequence[str]], env: Mapping[str, str], timeout_s: float = 1800) -> None:
    procs: list[subprocess.Popen] = []
    try:
        for command in commands:
            procs.append(subprocess.Popen(list(command), env=dict(env), start_new_session=True))
        for index, proc in enumerate(procs):
            if proc.wait(timeout=timeout_s) != 0:
                raise SystemExit(f"bench worker {index} exited {proc.returncode}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
