"""Debian packages behind the tests' own services, installed when missing, so that a fresh
machine's ``make test`` runs those tests instead of skipping them (``make services`` installs
them all at once beforehand; CI does).

Not a test module. ``ensure(packages, present, what)``: None when ``present()`` holds, after
installing ``packages`` with apt-get when it did not (root only; ``apt-get update`` only when
the first install fails); else the reason, for a skip. Blocks while apt-get runs; idempotent.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Callable, Sequence

__all__ = ["ensure", "open_mpi_unavailable"]


def ensure(packages: Sequence[str], present: Callable[[], bool], what: str) -> str | None:
    """None once ``present()`` holds (installing ``packages`` first where it did not); else why not."""
    if present():
        return None
    listed = " ".join(packages)
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{what} is not installed and cannot be here (apt-get install {listed} needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", *packages]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    if present():
        return None
    return f"apt-get install {listed} did not install {what}: {done.stderr.strip()[-300:] or 'no error given'}"


def open_mpi_unavailable() -> str | None:
    """None when Open MPI's ``mpirun`` and ``orted`` are here (Debian's openmpi-bin, installed
    when missing); else why not."""
    return ensure(["openmpi-bin"], lambda: shutil.which("mpirun") is not None and shutil.which("orted") is not None,
                  "Open MPI (mpirun, orted)")
