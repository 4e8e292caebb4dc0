"""A small chaos helper: find a torchrelay job's processes by their environment, signal them by pid.

Contract:
- Processes are found by reading ``/proc/<pid>/environ`` (only this user's are readable):
  ``RELAY_JOB_ID`` names the job, ``RELAY_ATTEMPT`` the attempt, ``RANK`` the worker's rank.
  Zombies have no environment and are never listed. A rank forked by an agent's warm zygote
  shows the zygote's environment: it is found through its launch's ``ranks.json`` (next to
  its working directory), with the launch's store host (rank None).
- ``worker_pids`` returns the *script* processes (the user's training code). Under the
  worker exit hook each rank is a supervisor plus the script process it forked, both with the
  rank's ``RANK``; the script process is the one whose parent is that supervisor. For a rank
  run without the hook (one process) that process is returned.
- Signalling functions act on the given pids only, never on groups or names; a pid already
  gone is skipped. Nothing here starts or waits for processes except ``wait_until``.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class JobProcess:
    pid: int
    ppid: int
    rank: int | None     # None for torchrun itself (it has no RANK)
    attempt: int | None


def _environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0]


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def job_processes(job_id: str, attempt: int | None = None) -> list[JobProcess]:
    """Live processes of ``job_id`` (torchrun, supervisors, scripts), optionally of one attempt.

    With ``RELAY_HOME`` set (the test's cluster), only processes launched under that home:
    every cluster's first job is ``job-1``, and another test's must never be hit."""
    out = []
    me = os.getpid()
    home = os.environ.get("RELAY_HOME")
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        env = _environ(pid)
        if not env or env.get("RELAY_JOB_ID") != job_id:
            continue
        if home and not env.get("RELAY_LAUNCH_DIR", "").startswith(home.rstrip("/") + "/"):
            continue
        stat = _ppid_and_state(pid)
        if stat is None or stat[1] == "Z":
            continue
        proc = JobProcess(pid=pid, ppid=stat[0], rank=_int(env.get("RANK")), attempt=_int(env.get("RELAY_ATTEMPT")))
        if attempt is None or proc.attempt == attempt:
            out.append(proc)
    out += _warm_processes(job_id, attempt, home)
    return sorted(out, key=lambda p: p.pid)


def _warm_ranks(pid: int) -> dict | None:
    """For a rank forked by an agent's warm zygote (its environment and command line are the
    zygote's): its launch's ``ranks.json``, found next to its working directory (the launch's
    ``code`` folder). None for any other process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"torchrelay.agent.zygote" not in fh.read():
                return None
        cwd = os.readlink(f"/proc/{pid}/cwd")
        with open(os.path.join(os.path.dirname(cwd), "ranks.json")) as fh:
            import json

            return {**json.load(fh), "run_dir": os.path.dirname(cwd)}
    except (OSError, ValueError):
        return None


def _warm_processes(job_id: str, attempt: int | None, home: str | None) -> list[JobProcess]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        record = _warm_ranks(pid)
        if record is None or record.get("job_id") != job_id:
            continue
        if home and not record["run_dir"].startswith(home.rstrip("/") + "/"):
            continue
        rank = next((int(r) for r, p in record["ranks"].items() if p == pid), None)
        stat = _ppid_and_state(pid)
        if (rank is None and pid != record.get("store")) or stat is None or stat[1] == "Z":
            continue
        if attempt is None or record["attempt"] == attempt:
            out.append(JobProcess(pid=pid, ppid=stat[0], rank=rank, attempt=record["attempt"]))
    return out


def job_pids(job_id: str, attempt: int | None = None) -> list[int]:
    """Pids of every live process of the job (or of one attempt of it)."""
    return [p.pid for p in job_processes(job_id, attempt)]


def worker_pids(job_id: str, rank: int | None = None, attempt: int | None = None) -> dict[int, int]:
    """``{rank: pid}`` of the job's script processes (see the module docstring)."""
    procs = [p for p in job_processes(job_id, attempt) if p.rank is not None]
    out: dict[int, int] = {}
    for r in sorted({p.rank for p in procs}):
        if rank is not None and r != rank:
            continue
        of_rank = [p for p in procs if p.rank == r]
        pids = {p.pid for p in of_rank}
        scripts = [p for p in of_rank if p.ppid in pids]
        if scripts:
            out[r] = scripts[0].pid
        elif len(of_rank) == 1:
            out[r] = of_rank[0].pid
    return out


def signal_pids(pids: Iterable[int], sig: int) -> list[int]:
    """Send ``sig`` to each pid; returns those it reached."""
    reached = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            reached.append(pid)
        except ProcessLookupError:
            pass
    return reached


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal one process (SIGKILL by default). False if it was already gone."""
    return bool(signal_pids([pid], sig))


def freeze(pid: int) -> bool:
    """SIGSTOP one process (it hangs where it is, e.g. inside a collective)."""
    return kill(pid, signal.SIGSTOP)


def thaw(pid: int) -> bool:
    """SIGCONT one process."""
    return kill(pid, signal.SIGCONT)


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy (returned); AssertionError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
