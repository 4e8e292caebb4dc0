"""The Slurm client commands the executor runs, each one subprocess with a timeout.

Contract:
- ``SlurmCommands(env=None, timeout_s=30)``: runs ``sbatch``, ``squeue``, ``sacct``,
  ``scancel``, ``sinfo`` with ``env`` (None: this process's environment, so ``SLURM_CONF``
  and the like apply). Blocks for at most ``timeout_s`` per call; thread-safe.
- ``calls``: how many times each command ran (``Counter``; what the benchmark reads).
- ``sbatch(script, cwd)``: the job id (``--parsable``; a ``;cluster`` suffix dropped). Raises
  ``SlurmRefused`` with sbatch's own words when it refuses the job, ``ExecutorUnavailable``
  when the controller cannot be reached.
- ``squeue(ids)``, ``sacct(ids)``, ``sinfo(partition)``: the command's text in the fixed
  formats of ``slurm_batch`` / ``slurm_status``. Raise ``ExecutorUnavailable`` naming the
  command and its error when it fails (controller down, timeout, command missing).
- ``job_ids_named(name)``: the ids Slurm still lists under a job name (``squeue --name``), a
  heterogeneous job's once (its leader's).
- ``scancel(ids, signal=None)``: one call for all ``ids``; ``signal``: signal the job steps
  only (``scancel -s SIG``), the job is not cancelled. Unknown ids are not an error.
"""
from __future__ import annotations

import collections
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from torchrelay.errors import ExecutorUnavailable, RelayError
from torchrelay.server.executors.slurm_batch import SINFO_FORMAT
from torchrelay.server.executors.slurm_status import SACCT_FORMAT, SQUEUE_FORMAT, leader_id

# squeue's answer when none of the ids is known any more (it exits 1 for that alone)
_NO_SUCH_JOB = "Invalid job id specified"


class SlurmRefused(RelayError):
    """sbatch refused the job: its own message, verbatim."""

    http_status = 422


class SlurmCommands:
    """See the module docstring."""

    def __init__(self, env: Mapping[str, str] | None = None, timeout_s: float = 30.0):
        self.env = dict(env) if env is not None else None
        self.timeout_s = timeout_s
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _run(self, argv: Sequence[str], cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        with self._lock:
            self.calls[argv[0]] += 1
        try:
            return subprocess.run(list(argv), env=self.env, cwd=cwd, capture_output=True, text=True,
                                  timeout=self.timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ExecutorUnavailable(f"`{' '.join(argv[:3])} …` did not answer within "
                                      f"{self.timeout_s:g} s") from None
        except OSError as exc:
            raise ExecutorUnavailable(f"cannot run {argv[0]!r}: {exc}; is slurm-client installed?") from None

    def _checked(self, argv: Sequence[str]) -> str:
        done = self._run(argv)
        if done.returncode != 0:
            raise ExecutorUnavailable(f"`{' '.join(argv[:2])} …` failed ({done.returncode}): "
                                      f"{done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def sbatch(self, script: Path, cwd: Path) -> str:
        done = self._run(["sbatch", "--parsable", str(script)], cwd=cwd)
        if done.returncode != 0:
            text = done.stderr.strip() or done.stdout.strip()
            if "Unable to contact slurm controller" in text or "Socket timed out" in text:
                raise ExecutorUnavailable(f"sbatch: {text}")
            raise SlurmRefused(text or f"sbatch exited with {done.returncode}")
        return done.stdout.strip().split(";")[0]

    def squeue(self, ids: Sequence[str]) -> str:
        argv = ["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-O", SQUEUE_FORMAT]
        done = self._run(argv)
        if done.returncode != 0:
            if _NO_SUCH_JOB in done.stderr:
                return ""
            raise ExecutorUnavailable(f"squeue failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def job_ids_named(self, name: str) -> list[str]:
        """Ids of the jobs Slurm still lists under ``name`` (any state); a heterogeneous job once,
        by its leader's id (its components ``123+0``, ``123+1`` as ``123``)."""
        ids = self._checked(["squeue", "-h", "-t", "all", "--name", name, "-o", "%i"]).split()
        return list(dict.fromkeys(leader_id(x) for x in ids))

    def sacct(self, ids: Sequence[str]) -> str:
        return self._checked(["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o", SACCT_FORMAT])

    def sinfo(self, partition: str) -> str:
        return self._checked(["sinfo", "-h", "-N", "-p", partition, "-o", SINFO_FORMAT])

    def scancel(self, ids: Sequence[str], signal: str | None = None) -> None:
        if ids:
            self._checked(["scancel", *(["-s", signal] if signal else []), *ids])
