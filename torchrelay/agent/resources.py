"""What this node offers, as detected: CPUs, memory, GPUs, launchers (torch is never imported here).

Contract: ``detect_cpus`` (the affinity mask, else ``os.cpu_count()``), ``detect_memory``
(``/proc/meminfo``; 0 if unreadable), ``detect_gpus`` (``nvidia-smi -L``; ``(0, None)``
without it) and ``detect_launcher_labels`` (``wire.MPIRUN_LABEL`` when Open MPI's ``mpirun``
and ``orted`` are on ``PATH``) never raise; ``parse_nvidia_smi_list`` is pure.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from torchrelay.wire import MPIRUN_LABEL


def detect_cpus() -> float:
    """CPUs this process may run on (affinity mask), else ``os.cpu_count()``."""
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return float(os.cpu_count() or 1)


def detect_memory() -> int:
    """Total memory in bytes from ``/proc/meminfo`` (0 if it cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def parse_nvidia_smi_list(text: str) -> tuple[int, str | None]:
    """``(count, type of the first)`` from ``nvidia-smi -L`` output.

    A line looks like ``GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)``.
    """
    names = []
    for line in text.splitlines():
        if line.startswith("GPU ") and ":" in line:
            name = line.split(":", 1)[1].split("(UUID", 1)[0].strip()
            names.append(name)
    return len(names), (names[0] if names else None)


def detect_gpus() -> tuple[int, str | None]:
    """GPUs from ``nvidia-smi -L`` (no torch import: the agent stays light); (0, None) if none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0, None
    if out.returncode != 0:
        return 0, None
    return parse_nvidia_smi_list(out.stdout)


def detect_launcher_labels(path: str | None = None) -> dict[str, str]:
    """The labels of the launchers this node can run besides torchrun: ``wire.MPIRUN_LABEL``
    when Open MPI's ``mpirun`` and ``orted`` (its daemon, what other nodes run) are on ``path``."""
    if shutil.which("mpirun", path=path) and shutil.which("orted", path=path):
        return dict([MPIRUN_LABEL])
    return {}
