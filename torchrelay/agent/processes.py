"""A launch's processes on this machine: found by their environment, signalled, ended.

Contract:
- ``find_launch_processes(launch_id, launch_dir)``: pids of live processes whose environment has
  ``RELAY_LAUNCH_ID=<launch_id>`` and, when ``launch_dir`` is given,
  ``RELAY_LAUNCH_DIR=<its absolute path>``. Give ``launch_dir`` whenever signalling what is
  found: launch ids repeat across clusters on one machine (every cluster's first job has
  ``job-1-a1-n0``), a launch's folder does not. Reads ``/proc/*/environ`` (only this user's
  processes are readable; zombies have none).
- ``signal_group``, ``group_alive`` and ``signal_pids`` never raise for a process that is gone
  or not ours.
- ``end_processes(left, grace_s)``: SIGTERM what ``left()`` names (pids; a negative one is a
  process group), SIGKILL what is still named after ``grace_s``; blocks until ``left()`` is empty.
- ``kill_launch_processes(launch_id, launch_dir)``: SIGKILL every process of that launch at once
  (what an earlier agent left); returns how many there were.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence


def find_launch_processes(launch_id: str, launch_dir: str | os.PathLike | None = None) -> list[int]:
    """Pids of live processes tagged with the launch (see the module docstring)."""
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


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_pids(pids: Sequence[int], sig: int) -> None:
    """Signal each pid (a negative one: that process group)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_processes(left: Callable[[], list[int]], grace_s: float) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, until ``left()`` names nothing. Blocks."""
    remaining = left()
    if not remaining:
        return
    signal_pids(remaining, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while remaining:
        if time.monotonic() >= deadline:
            signal_pids(remaining, signal.SIGKILL)
        time.sleep(0.05)
        remaining = left()


def kill_launch_processes(launch_id: str, launch_dir: str | os.PathLike) -> int:
    """SIGKILL every process of the launch in ``launch_dir``; how many were found."""
    pids = find_launch_processes(launch_id, launch_dir)
    signal_pids(pids, signal.SIGKILL)
    return len(pids)
