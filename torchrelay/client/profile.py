"""``relay submit --profile``: run a job's entrypoint once, locally, and read its memory figures.

Contract:
- ``profile_memory(spec, base_dir)`` runs ``spec.entrypoint`` in the job's workdir as one process
  with the job's ``env`` and ``RELAY_PROFILE_OUT``/``RELAY_PROFILE_WORKERS``/``RELAY_STRATEGY``
  set (``torchrelay.train``'s profile run: two optimizer steps, then it exits 0 with the
  figures; see ``torchrelay/train/memory_profile.py``). Blocks up to ``timeout_s``; the process
  runs in its own session and is killed (its group) on timeout. Raises ``InvalidSpec`` when the
  script failed, or ended without a profile (it never called ``torchrelay.train.prepare``).
- ``recommended_memory(profile)`` (pure): one worker's training state under the job's strategy
  on its workers, plus the measured activations, times 1.2, plus the process's own overhead,
  rounded up to 64 MiB.
- ``describe_profile(profile)`` (pure): the lines the CLI prints.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from torchrelay.errors import InvalidSpec
from torchrelay.spec import JobSpec, format_memory

__all__ = ["describe_profile", "profile_memory", "recommended_memory"]

HEADROOM = 1.2
ROUND = 64 << 20


def profile_memory(spec: JobSpec, base_dir: Path, timeout_s: float = 600) -> dict[str, Any]:
    workdir = (base_dir / spec.workdir).resolve()
    with tempfile.TemporaryDirectory(prefix="relay-profile-") as tmp:
        out = Path(tmp) / "profile.json"
        env = {**os.environ, **spec.env, "RELAY_PROFILE_OUT": str(out), "RELAY_PROFILE_WORKERS": str(spec.workers),
               "RELAY_STRATEGY": json.dumps(spec.strategy.model_dump(mode="json")),
               "RELAY_OUTPUT_DIR": str(Path(tmp) / "outputs")}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "RELAY_JOB_ID", "RELAY_MEMORY_PER_WORKER"):
            env.pop(name, None)
        proc = subprocess.Popen(shlex.split(spec.entrypoint), cwd=workdir, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise InvalidSpec(f"--profile: {spec.entrypoint!r} ran past {timeout_s:.0f}s without two optimizer "
                              "steps") from None
        tail = "\n".join(output.splitlines()[-15:])
        if proc.returncode != 0:
            raise InvalidSpec(f"--profile: {spec.entrypoint!r} exited {proc.returncode}:\n{tail}")
        if not out.exists():
            raise InvalidSpec(f"--profile: {spec.entrypoint!r} ended without a profile: it must train through "
                              f"torchrelay.train.prepare (two optimizer steps); its last lines:\n{tail}")
        return json.loads(out.read_text())


def recommended_memory(profile: dict[str, Any]) -> int:
    need = profile["estimate"]["memory_training_state"] + profile["activations"]
    total = int(need * HEADROOM) + int(profile["overhead"])
    return -(-total // ROUND) * ROUND


def describe_profile(profile: dict[str, Any]) -> list[str]:
    est = profile["estimate"]
    return [f"profile: one worker of {profile['workers']} under {profile['strategy']}: parameters "
            f"{format_memory(int(est['memory_parameters']))}, gradients {format_memory(int(est['memory_gradients']))}, "
            f"optimizer state {format_memory(int(est['memory_optimizer_state']))} (estimated), activations "
            f"{format_memory(int(profile['activations']))} (measured), process overhead "
            f"{format_memory(int(profile['overhead']))} (measured)",
            f"profile: resources.memory {format_memory(recommended_memory(profile))} per worker"]
