"""How much CPU this process may use: the least of its cgroups' CPU quotas, its CPU affinity and
torch's intra-op threads. What the balancer's first split assumes before it has measured a step.

Contract:
- ``cpu_dirs(self_cgroup, mounts)`` (pure): from the text of ``/proc/self/cgroup`` and
  ``/proc/self/mounts``, the cgroup version and the directories whose CPU quota binds this
  process: its own cgroup's and every ancestor's up to the hierarchy's root (a quota anywhere
  above caps everything below it: an agent's offer holds its launches). ``None`` when no
  hierarchy with the ``cpu`` controller is mounted (v1 wins where both are, as the agent's does).
- ``quota_cpus(version, texts)`` (pure): the CPUs a quota allows, from a v1 group's
  ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` texts, or a v2 group's ``cpu.max`` text;
  ``None`` for no limit (``-1``, ``max``) or text that does not parse.
- ``cpu_allowance()`` (reads ``/proc`` and the cgroup files; never raises): the least of the
  quotas on the path, ``len(os.sched_getaffinity(0))`` and ``torch.get_num_threads()`` (a rank
  whose torch computes on one thread uses one CPU, however many it may). A file that cannot
  be read counts as no limit.

Why by hand: neither torch nor the standard library reads a cgroup's quota (``os.cpu_count``
and ``os.process_cpu_count`` see the CPUs, not the quota). The text of ``/proc`` is parsed by
the agent's own parsers (``agent.cgroup_plan.parse_mounts``, ``parse_self_cgroup``).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from torchrelay.agent.cgroup_plan import parse_mounts, parse_self_cgroup

__all__ = ["cpu_allowance", "cpu_dirs", "quota_cpus"]


def cpu_dirs(self_cgroup: str, mounts: str) -> tuple[int, list[str]] | None:
    """(version, the directories from this process's cgroup up to the root), or None (see the module docstring)."""
    v1_mounts, v2_mount = parse_mounts(mounts, ("cpu",))
    own_v1, own_v2 = parse_self_cgroup(self_cgroup)
    if "cpu" in v1_mounts and "cpu" in own_v1:
        version, mount, own = 1, v1_mounts["cpu"], own_v1["cpu"]
    elif v2_mount is not None and self_cgroup.strip():
        version, mount, own = 2, v2_mount, own_v2
    else:
        return None
    parts = [p for p in own.split("/") if p and p != ".."]
    return version, [str(Path(mount, *parts[:n])) for n in range(len(parts), -1, -1)]


def quota_cpus(version: int, texts: tuple[str, ...]) -> float | None:
    """CPUs allowed by one group's quota (see the module docstring): ``texts`` is (quota, period) for v1, (cpu.max,) for v2."""
    try:
        if version == 1:
            quota, period = int(texts[0]), int(texts[1])
        else:
            limit, _, period_text = texts[0].strip().partition(" ")
            if limit == "max":
                return None
            quota, period = int(limit), int(period_text or 100_000)
    except (ValueError, IndexError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def cpu_allowance() -> float:
    """The CPUs this process can use (see the module docstring); at least a little above 0."""
    limits = [float(torch.get_num_threads())]
    try:
        limits.append(float(len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        limits.append(float(os.cpu_count() or 1))
    self_cgroup, mounts = _read("/proc/self/cgroup"), _read("/proc/self/mounts")
    found = cpu_dirs(self_cgroup, mounts) if self_cgroup and mounts else None
    if found is not None:
        version, dirs = found
        names = ("cpu.cfs_quota_us", "cpu.cfs_period_us") if version == 1 else ("cpu.max",)
        for directory in dirs:
            texts = tuple(_read(os.path.join(directory, name)) for name in names)
            if all(t is not None for t in texts):
                cpus = quota_cpus(version, texts)  # type: ignore[arg-type]
                if cpus is not None:
                    limits.append(cpus)
    return max(min(limits), 1e-3)
