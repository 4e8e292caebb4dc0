"""What the agent writes where to enforce CPU and memory with cgroups (v1 or v2). Pure.

No I/O and no clock: every function maps text (``/proc/self/mounts``, ``/proc/self/cgroup``
(``parse_mounts``, ``parse_self_cgroup``; also what ``train.cpu_allowance`` reads them with),
a cgroup's ``memory.events``) or values (an offer, a launch's resources) to values, and
``torchrelay.agent.cgroups`` carries the result out.

The tree (``<own>`` is the agent's own cgroup in each hierarchy, or ``--cgroup-parent``)::

    <own>/torchrelay-agent-<pid>[-<n>]/      the agent's offer: a hard CPU quota (--cpus) and a
                                             hard memory limit (--memory)
    <own>/torchrelay-agent-<pid>/<launch>/   one launch: a CPU weight in proportion to what it was
                                             granted (cpu x workers) and a hard memory limit
                                             (memory x workers, when the job gave one)

So the offer is a ceiling (two agents offering 1 and 0.5 cpu run their workers at a real 2:1),
a launch's ``cpu`` is what it is guaranteed when launches compete (Kubernetes' request), and its
``memory`` is a hard limit (memory cannot be lent back). ``plan_group`` lists the writes of one
directory, in order; ``join_command`` wraps an argv so that its first process joins a launch's
cgroups before it ``exec``s (nothing it forks can escape); ``oom_kills`` reads the kernel's
counter of OOM kills of a cgroup, ``memory_reason`` says it in words ("memory limit 1 GiB
exceeded").
"""
from __future__ import annotations

import re
import math
from dataclasses import dataclass

CONTROLLERS = ("cpu", "memory")
# The CFS period: the quota is cpus x this per period. 10 ms, not the kernel's default 100 ms:
# a group at 0.5 cpu runs 50 ms then stalls 50 ms under a 100 ms period, and in synchronous
# data parallel every rank waits out its slowest peer's stall at the next all-reduce (steps
# here take a few ms); a 10 ms period caps a stall at 5 ms, so the quota acts as a rate, which
# is what the balanced shares measure (Kubernetes exposes the same knob, cpuCFSQuotaPeriod,
# for the same reason). A quota too small for it stretches the period instead (``_period_us``).
# Not shorter: a 2 ms period made bench/hetero.py's solo jobs (1 and 0.5 cpu) about 20 % slower
# in a probe (2026-12-05), and the pair's wait in the all-reduce did not shrink.
PERIOD_US = 10_000
MAX_PERIOD_US = 1_000_000  # the kernel's largest period
MIN_QUOTA_US = 1_000  # the kernel's smallest quota
AGENT_GROUP_PREFIX = "torchrelay-agent-"


class CgroupUnavailable(RuntimeError):
    """No cgroup hierarchy with the ``cpu`` and ``memory`` controllers is mounted here."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The mounted hierarchy the agent uses: ``version`` 1 or 2; ``dirs`` maps each controller to
    the directory of the agent's parent cgroup in it (v2: the same one for both)."""

    version: int
    dirs: tuple[tuple[str, str], ...]  # (controller, absolute directory)

    def dir_of(self, controller: str) -> str:
        return dict(self.dirs)[controller]

    def parents(self) -> tuple[str, ...]:
        """The distinct parent directories (v1: one per controller; v2: one)."""
        return tuple(dict.fromkeys(d for _, d in self.dirs))


@dataclass(frozen=True, slots=True)
class Limits:
    """What one cgroup enforces. ``cpus``: a hard quota in CPUs (None: none); ``cpu_weight``:
    the CPUs it is guaranteed under contention, as a relative weight (None: the default);
    ``memory``: a hard limit in bytes (None: none), of which ``launcher_memory`` is the
    allowance of the process that starts a launch's workers (``LAUNCHER_ALLOWANCE``)."""

    cpus: float | None = None
    cpu_weight: float | None = None
    memory: int | None = None
    launcher_memory: int = 0

    @property
    def granted_memory(self) -> int | None:
        """What the job asked for (memory x workers), the figure a user recognises."""
        return None if self.memory is None else self.memory - self.launcher_memory


@dataclass(frozen=True, slots=True)
class Write:
    path: str
    value: str


def agent_limits(cpus: float, memory: int) -> Limits:
    """The agent's offer as hard limits (a memory of 0, unknown, is no limit)."""
    return Limits(cpus=cpus if cpus > 0 else None, memory=memory if memory > 0 else None)


# The process that starts a launch's workers (torchrun; mpirun or orted) sits in the launch's
# group too, and with torch imported torchrun holds about 300 MiB here: it is allowed this much
# on top of memory x workers, so that the workers themselves get what the job spec says.
LAUNCHER_ALLOWANCE = 512 << 20


def launch_limits(cpu_per_worker: float, memory_per_worker: int, workers: int,
                  launcher_process: bool = False) -> Limits:
    """A launch's grant: its CPU as a weight, its memory as a hard limit (0: not given, none),
    plus ``LAUNCHER_ALLOWANCE`` when a launcher process (torchrun, mpirun) shares the group."""
    if memory_per_worker <= 0:
        return Limits(cpu_weight=cpu_per_worker * workers if cpu_per_worker > 0 else None)
    extra = LAUNCHER_ALLOWANCE if launcher_process else 0
    return Limits(cpu_weight=cpu_per_worker * workers if cpu_per_worker > 0 else None,
                  memory=memory_per_worker * workers + extra, launcher_memory=extra)


# ---------------------------------------------------------------- finding the hierarchy

def _join(*parts: str) -> str:
    path = "/".join(p.strip("/") for p in parts if p.strip("/"))
    return "/" + path


def parse_mounts(mounts: str, controllers: tuple[str, ...] = CONTROLLERS) -> tuple[dict[str, str], str | None]:
    """From ``/proc/self/mounts``: where each of ``controllers`` is mounted as cgroup v1 (the
    first mount that carries it), and the first cgroup2 mount (None: none)."""
    v1_mounts: dict[str, str] = {}
    v2_mount = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        where, fstype, options = fields[1], fields[2], fields[3].split(",")
        if fstype == "cgroup":
            for controller in controllers:
                if controller in options:
                    v1_mounts.setdefault(controller, where)
        elif fstype == "cgroup2" and v2_mount is None:
            v2_mount = where
    return v1_mounts, v2_mount


def parse_self_cgroup(self_cgroup: str) -> tuple[dict[str, str], str]:
    """From ``/proc/self/cgroup``: this process's cgroup in each v1 controller's hierarchy, and
    its v2 cgroup ("/" when the file has no v2 line)."""
    own_v1: dict[str, str] = {}
    own_v2 = "/"
    for line in self_cgroup.splitlines():
        number, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if number == "0" and names == "":
            own_v2 = path or "/"
        for name in names.split(","):
            own_v1[name] = path or "/"
    return own_v1, own_v2


def detect_layout(mounts: str, self_cgroup: str, v2_controllers: str = "", parent: str | None = None) -> Layout:
    """The hierarchy to use, from ``/proc/self/mounts``, ``/proc/self/cgroup`` and the v2 root's
    ``cgroup.controllers`` (read by the caller when a cgroup2 mount exists). v1 wins when both
    ``cpu`` and ``memory`` are mounted there (a hybrid host); else v2 when its root has both.
    ``parent`` (a path inside the hierarchy) replaces the agent's own cgroup. Raises
    ``CgroupUnavailable`` naming what is missing."""
    v1_mounts, v2_mount = parse_mounts(mounts)
    own_v1, own_v2 = parse_self_cgroup(self_cgroup)
    if all(c in v1_mounts for c in CONTROLLERS):
        return Layout(1, tuple((c, _join(v1_mounts[c], parent or own_v1.get(c, "/"))) for c in CONTROLLERS))
    available = set(v2_controllers.split())
    if v2_mount is not None and set(CONTROLLERS) <= available:
        where = _join(v2_mount, parent or own_v2)
        return Layout(2, tuple((c, where) for c in CONTROLLERS))
    missing = [c for c in CONTROLLERS if c not in v1_mounts]
    v2_note = (f"the cgroup2 mount {v2_mount} offers {sorted(available) or 'no controllers'}" if v2_mount
               else "no cgroup2 mount")
    raise CgroupUnavailable(f"no cgroup hierarchy with cpu and memory: cgroup v1 lacks {missing}, {v2_note}; "
                            "mount them, or run the agent with --cgroups off")


def agent_group_name(pid: int, instance: int = 0) -> str:
    """The group of the agent process ``pid`` (``instance``: the how-manieth agent in that
    process, for tests that run several in one)."""
    return f"{AGENT_GROUP_PREFIX}{pid}" + (f"-{instance}" if instance else "")


def agent_pid_of(name: str) -> int | None:
    """The agent pid a group of ours was named after (None: not one of ours)."""
    match = re.fullmatch(re.escape(AGENT_GROUP_PREFIX) + r"(\d+)(?:-\d+)?", name)
    return int(match.group(1)) if match else None


def launch_group_name(launch_id: str) -> str:
    """A directory name for a launch (anything but ``[A-Za-z0-9._-]`` becomes ``_``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", launch_id)
    return name if name not in ("", ".", "..") else f"launch_{name}"


def group_dirs(layout: Layout, *names: str) -> tuple[str, ...]:
    """The directories of the group ``names`` (nested under the parent) in each hierarchy."""
    return tuple(_join(parent, *names) for parent in layout.parents())


def procs_files(layout: Layout, *names: str) -> tuple[str, ...]:
    """The ``cgroup.procs`` files a process writes itself into to join the group."""
    return tuple(f"{d}/cgroup.procs" for d in group_dirs(layout, *names))


# ---------------------------------------------------------------- what to write

def _shares(cpus: float) -> int:
    return max(2, round(1024 * cpus))


def _weight(cpus: float) -> int:
    # the conversion of shares to weight that runc and Kubernetes use
    return max(1, min(10_000, 1 + ((_shares(cpus) - 2) * 9_999) // 262_142))


def _period_us(cpus: float) -> int:
    """``PERIOD_US``, or longer where ``cpus`` x ``PERIOD_US`` is under the smallest quota."""
    return min(MAX_PERIOD_US, max(PERIOD_US, math.ceil(MIN_QUOTA_US / cpus))) if cpus > 0 else PERIOD_US


def _quota_us(cpus: float) -> int:
    return max(MIN_QUOTA_US, round(cpus * _period_us(cpus)))


def plan_group(layout: Layout, names: tuple[str, ...], limits: Limits, *, swap_files: bool = True,
               delegate: bool = False) -> list[Write]:
    """The writes that set ``limits`` on the group ``names``, in order. ``swap_files``: the
    kernel accounts swap (``memory.memsw.*`` / ``memory.swap.max`` exist), which then may not
    stretch the memory limit. ``delegate`` (v2): the group will hold groups of its own, so it
    enables the controllers for them (and its parent for it)."""
    writes: list[Write] = []
    if layout.version == 1:
        cpu_dir = _join(layout.dir_of("cpu"), *names)
        mem_dir = _join(layout.dir_of("memory"), *names)
        if limits.cpus is not None:
            writes += [Write(f"{cpu_dir}/cpu.cfs_period_us", str(_period_us(limits.cpus))),
                       Write(f"{cpu_dir}/cpu.cfs_quota_us", str(_quota_us(limits.cpus)))]
        if limits.cpu_weight is not None:
            writes.append(Write(f"{cpu_dir}/cpu.shares", str(_shares(limits.cpu_weight))))
        if limits.memory is not None:
            writes.append(Write(f"{mem_dir}/memory.limit_in_bytes", str(limits.memory)))
            if swap_files:
                writes.append(Write(f"{mem_dir}/memory.memsw.limit_in_bytes", str(limits.memory)))
        return writes
    parent = layout.dir_of("cpu")
    where = _join(parent, *names)
    enable = " ".join(f"+{c}" for c in CONTROLLERS)
    if delegate:
        writes += [Write(f"{_join(parent, *names[:-1])}/cgroup.subtree_control", enable),
                   Write(f"{where}/cgroup.subtree_control", enable)]
    if limits.cpus is not None:
        writes.append(Write(f"{where}/cpu.max", f"{_quota_us(limits.cpus)} {_period_us(limits.cpus)}"))
    if limits.cpu_weight is not None:
        writes.append(Write(f"{where}/cpu.weight", str(_weight(limits.cpu_weight))))
    if limits.memory is not None:
        writes.append(Write(f"{where}/memory.max", str(limits.memory)))
        if swap_files:
            writes.append(Write(f"{where}/memory.swap.max", "0"))
    return writes


def join_command(procs: tuple[str, ...], argv: list[str]) -> list[str]:
    """``argv`` run by a shell that first writes itself ("0": the writer) into each of
    ``procs``, then ``exec``s it: the launch's first process and all it forks are in the group
    from their first instruction. Exit code 125, with the reason on stderr, if it cannot join.
    A shell, not Python's ``preexec_fn``: the agent is threaded, and a fork of a threaded
    interpreter may only call async-signal-safe functions."""
    script = ('while [ "$1" != -- ]; do echo 0 > "$1" || { echo "cannot join cgroup $1" >&2; exit 125; }; '
              'shift; done; shift; exec "$@"')
    return ["/bin/sh", "-c", script, "relay-cgroup", *procs, "--", *argv]


# ---------------------------------------------------------------- reading what happened

def oom_kills(text: str) -> int:
    """The ``oom_kill`` count in a v1 ``memory.oom_control`` or a v2 ``memory.events`` (0 when
    the kernel does not report it)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


def format_bytes(num: int) -> str:
    """``1073741824 -> '1 GiB'``, ``1610612736 -> '1.5 GiB'``, ``1000 -> '1000 B'``."""
    size = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            text = f"{size:.0f}" if unit == "B" or size == int(size) else f"{size:.1f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def memory_reason(launch_memory: int | None, agent_memory: int | None) -> str:
    """Why the kernel killed a process of a launch: the launch's own limit when it had one,
    else the agent's offer."""
    if launch_memory is not None:
        return f"memory limit {format_bytes(launch_memory)} exceeded"
    if agent_memory is not None:
        return f"the node's memory offer {format_bytes(agent_memory)} exceeded"
    return "out of memory (killed by the kernel's OOM killer)"
