"""The agent's cgroups on this machine: its offer as a ceiling, one group per launch (effects).

What is written where is ``torchrelay.agent.cgroup_plan``'s (pure); this module creates the
directories, writes the files, moves processes and removes the groups.

Contract:
- ``AgentCgroups.open(cpus=, memory=, parent=None)`` finds the hierarchy (``/proc/self/mounts``,
  ``/proc/self/cgroup``), removes groups an earlier agent of this machine left (their agent pid
  is gone; whatever still runs in them is killed), creates ``torchrelay-agent-<pid>`` with the
  offer as hard limits and returns it. Raises ``CgroupUnavailable`` (no hierarchy, not root) or
  ``CgroupError`` (a write refused, named with its path and value).
- ``AgentCgroups.launch(launch_id, cpu_per_worker=, memory_per_worker=, workers=)`` -> a
  ``LaunchCgroup`` (nothing is created until its ``create``).
- ``LaunchCgroup.create()`` makes the group and sets its limits (raises ``CgroupError``);
  ``wrap(argv)`` is ``argv`` joining the group before it ``exec``s (for a process the backend
  starts); ``add(pid)`` puts a running process in it (for one forked elsewhere, e.g. by a
  zygote; any backend may call it; idempotent); ``release()`` reads how many processes the
  kernel's OOM killer ended and why, kills what is still in the group, removes it and returns
  a ``Release``. ``release`` is idempotent and never raises: a launch that failed to start
  still gets its group removed.
- ``AgentCgroups.close()`` releases every launch group still there, then removes the agent's.
  Idempotent.
- ``cgroups_usable()``: root, and a hierarchy with both controllers (a reason when not).
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torchrelay.agent import cgroup_plan as plan
from torchrelay.agent.cgroup_plan import CgroupUnavailable, Layout, Limits

log = logging.getLogger(__name__)

__all__ = ["AgentCgroups", "CgroupError", "CgroupUnavailable", "LaunchCgroup", "Release", "cgroups_usable",
           "detect"]

REMOVE_TIMEOUT_S = 10.0
_instances = itertools.count()  # agents of this process (tests run several in one)


class CgroupError(OSError):
    """A cgroup could not be created, limited or joined (the message names the path). An
    ``OSError``: to a launch it is a process that could not be started."""


@dataclass(frozen=True, slots=True)
class Release:
    """What a launch's group saw: processes the OOM killer ended, and the reason in words."""

    oom_kills: int
    reason: str | None  # e.g. "memory limit 1 GiB exceeded"; None without OOM kills


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def detect(parent: str | None = None) -> Layout:
    """The hierarchy this machine mounts (see ``cgroup_plan.detect_layout``). Raises
    ``CgroupUnavailable``."""
    try:
        mounts, own = _read("/proc/self/mounts"), _read("/proc/self/cgroup")
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read /proc/self/mounts or /proc/self/cgroup: {exc}") from None
    v2_controllers = ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            try:
                v2_controllers = _read(f"{fields[1]}/cgroup.controllers")
            except OSError:
                pass
            break
    return plan.detect_layout(mounts, own, v2_controllers, parent)


def cgroups_usable() -> tuple[bool, str]:
    """Whether this process can enforce limits here, and if not, why."""
    if os.geteuid() != 0:
        return False, "cgroup limits need root (the agent runs as uid %d)" % os.geteuid()
    try:
        detect()
    except CgroupUnavailable as exc:
        return False, str(exc)
    return True, ""


def _apply(writes: list[plan.Write]) -> None:
    for write in writes:
        try:
            with open(write.path, "w") as fh:
                fh.write(write.value)
        except OSError as exc:
            hint = ""
            if exc.errno == errno.EBUSY and write.path.endswith("cgroup.subtree_control"):
                hint = ("; a v2 cgroup with processes in it cannot delegate controllers: give the agent "
                        "--cgroup-parent a cgroup of its own (e.g. /torchrelay)")
            raise CgroupError(f"cannot write {write.value!r} to {write.path}: {exc.strerror}{hint}") from None


def _members(directory: str) -> list[int]:
    try:
        return [int(x) for x in _read(f"{directory}/cgroup.procs").split()]
    except (OSError, ValueError):
        return []


def _remove_dir(directory: str, deadline: float) -> bool:
    """Kill what is left in ``directory`` (a leaf group of ours) and remove it, until
    ``deadline``; True once it is gone."""
    while True:
        for pid in _members(directory):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                log.warning("cannot remove cgroup %s: %s", directory, exc)
                return False
        time.sleep(0.02)  # a killed process leaves the group once it was reaped


class LaunchCgroup:
    """One launch's group (see the module docstring)."""

    def __init__(self, agent: AgentCgroups, name: str, limits: Limits):
        self.agent = agent
        self.names = (agent.name, name)
        self.limits = limits
        self.dirs = plan.group_dirs(agent.layout, *self.names)
        self.procs = plan.procs_files(agent.layout, *self.names)
        self._lock = threading.Lock()
        self._created = False
        self._released: Release | None = None

    def create(self) -> None:
        """Make the group with its limits. Raises ``CgroupError``; what was made is removed."""
        with self._lock:
            if self._created or self._released is not None:
                return
            try:
                for directory in self.dirs:
                    os.makedirs(directory, exist_ok=True)
                self._created = True
                _apply(plan.plan_group(self.agent.layout, self.names, self.limits,
                                       swap_files=self.agent.swap_files))
            except OSError as exc:
                self._created = True
                self._release_locked()
                raise CgroupError(f"cannot create cgroup {self.dirs[0]}: {exc}") from None
            except CgroupError:
                self._release_locked()
                raise

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` joining this group before it starts (``cgroup_plan.join_command``)."""
        return plan.join_command(self.procs, argv)

    def add(self, pid: int) -> None:
        """Move the running process ``pid`` (only it, not children it already forked) into the
        group. Raises ``CgroupError`` (``ProcessLookupError``'s message when it is gone)."""
        for procs in self.procs:
            try:
                with open(procs, "w") as fh:
                    fh.write(str(pid))
            except OSError as exc:
                raise CgroupError(f"cannot move pid {pid} into {procs}: {exc.strerror}") from None

    def members(self) -> list[int]:
        return sorted({pid for d in self.dirs for pid in _members(d)})

    def oom_kills(self) -> int:
        """Processes of this group the OOM killer ended so far."""
        memory_dir = self.dirs[-1] if self.agent.layout.version == 1 else self.dirs[0]
        name = "memory.oom_control" if self.agent.layout.version == 1 else "memory.events"
        try:
            return plan.oom_kills(_read(f"{memory_dir}/{name}"))
        except OSError:
            return 0

    def release(self) -> Release:
        """Read the OOM count, end what is left, remove the group. Idempotent, never raises."""
        with self._lock:
            return self._release_locked()

    def _release_locked(self) -> Release:
        if self._released is not None:
            return self._released
        kills = self.oom_kills() if self._created else 0
        reason = plan.memory_reason(self.limits.granted_memory, self.agent.limits.memory) if kills else None
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        for directory in self.dirs:
            _remove_dir(directory, deadline)
        self._released = Release(oom_kills=kills, reason=reason)
        self.agent.forget(self)
        return self._released


class AgentCgroups:
    """The agent's group and its launches' (see the module docstring)."""

    def __init__(self, layout: Layout, limits: Limits, *, pid: int | None = None):
        self.layout = layout
        self.limits = limits
        self.name = plan.agent_group_name(os.getpid() if pid is None else pid, next(_instances))
        self.dirs = plan.group_dirs(layout, self.name)
        # whether swap is accounted (then it may not stretch a memory limit); v2: known once
        # the group exists with the memory controller enabled for it (``open``)
        self.swap_files = layout.version == 1 and os.path.exists(
            f"{layout.dir_of('memory')}/memory.memsw.limit_in_bytes")
        self._launches: dict[int, LaunchCgroup] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, *, cpus: float, memory: int, parent: str | None = None) -> AgentCgroups:
        """Find the hierarchy, sweep what dead agents left, create this agent's group."""
        if os.geteuid() != 0:
            raise CgroupUnavailable(f"cgroup limits need root (the agent runs as uid {os.geteuid()}); "
                                    "run it as root, or with --cgroups off")
        layout = detect(parent)
        sweep_dead_agents(layout)
        group = cls(layout, plan.agent_limits(cpus, memory))
        try:
            for directory in group.dirs:
                os.makedirs(directory, exist_ok=True)  # a --cgroup-parent that is missing is made, and kept
        except OSError as exc:
            group.close()
            raise CgroupError(f"cannot create cgroup {exc.filename}: {exc.strerror}") from None
        try:
            if layout.version == 2:  # delegate first: the limits' files appear with the controllers
                _apply(plan.plan_group(layout, (group.name,), Limits(), delegate=True))
                group.swap_files = os.path.exists(f"{group.dirs[0]}/memory.swap.max")
            _apply(plan.plan_group(layout, (group.name,), group.limits, swap_files=group.swap_files))
        except CgroupError:
            group.close()
            raise
        return group

    def launch(self, launch_id: str, *, cpu_per_worker: float, memory_per_worker: int,
               workers: int, launcher_process: bool = False) -> LaunchCgroup:
        """The (not yet created) group of one launch; ``launcher_process``: torchrun or mpirun
        starts its workers (``plan.LAUNCHER_ALLOWANCE``)."""
        cgroup = LaunchCgroup(self, plan.launch_group_name(launch_id),
                              plan.launch_limits(cpu_per_worker, memory_per_worker, workers, launcher_process))
        with self._lock:
            self._launches[id(cgroup)] = cgroup
        return cgroup

    def forget(self, cgroup: LaunchCgroup) -> None:
        with self._lock:
            self._launches.pop(id(cgroup), None)

    def close(self) -> None:
        """Release every launch group left, then remove the agent's. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            launches = list(self._launches.values())
        for cgroup in launches:
            cgroup.release()
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        for directory in self.dirs:
            _remove_tree(directory, deadline)


def _remove_tree(directory: str, deadline: float) -> None:
    """Remove a group of ours and the groups under it (deepest first)."""
    path = Path(directory)
    if not path.is_dir():
        return
    for child in sorted((p for p in path.iterdir() if p.is_dir()), reverse=True):
        _remove_tree(str(child), deadline)
    _remove_dir(directory, deadline)


def sweep_dead_agents(layout: Layout) -> int:
    """Remove the groups of agents of this machine that are gone (killed before ``close``),
    ending what still runs in them; returns how many were removed."""
    removed = 0
    deadline = time.monotonic() + REMOVE_TIMEOUT_S
    for parent in layout.parents():
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            pid = plan.agent_pid_of(name)
            if pid is None or pid == os.getpid() or _alive(pid):
                continue
            _remove_tree(f"{parent}/{name}", deadline)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone: its agent will never close its group)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False
