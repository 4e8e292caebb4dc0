"""What the agent writes where for cgroup v1 and v2 (pure tables; v2 is not mounted here)."""
from __future__ import annotations

import pytest

from torchrelay.agent import cgroup_plan as P

V1_MOUNTS = """\
tmpfs /sys/fs/cgroup tmpfs rw 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V1_COMOUNTED = "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\ncgroup /mem cgroup rw,memory 0 0\n"
V1_SELF = "4:memory:/process_api/abc\n3:cpuset:/\n1:cpu:/\n0::/\n"
V2_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"
V2_SELF = "0::/system.slice/relay-agent.service\n"

V1 = P.Layout(1, (("cpu", "/sys/fs/cgroup/cpu"), ("memory", "/sys/fs/cgroup/memory/process_api/abc")))
V2 = P.Layout(2, (("cpu", "/sys/fs/cgroup/relay"), ("memory", "/sys/fs/cgroup/relay")))


@pytest.mark.parametrize("mounts, own, v2_controllers, parent, expected", [
    # a hybrid host (this one): v1 has both controllers, so v1; nested under the agent's own groups
    (V1_MOUNTS, V1_SELF, "hugetlb", None, V1),
    # --cgroup-parent replaces the agent's own cgroup in each hierarchy
    (V1_MOUNTS, V1_SELF, "", "/torchrelay", P.Layout(1, (("cpu", "/sys/fs/cgroup/cpu/torchrelay"),
                                                         ("memory", "/sys/fs/cgroup/memory/torchrelay")))),
    # cpu co-mounted with cpuacct
    (V1_COMOUNTED, "5:cpu,cpuacct:/a\n4:memory:/b\n", "", None,
     P.Layout(1, (("cpu", "/sys/fs/cgroup/cpu,cpuacct/a"), ("memory", "/mem/b")))),
    # pure v2
    (V2_MOUNTS, V2_SELF, "cpuset cpu io memory pids", None,
     P.Layout(2, (("cpu", "/sys/fs/cgroup/system.slice/relay-agent.service"),
                  ("memory", "/sys/fs/cgroup/system.slice/relay-agent.service")))),
    (V2_MOUNTS, "0::/\n", "cpu memory", "/relay", V2),
])
def test_detect_layout_table(mounts, own, v2_controllers, parent, expected):
    assert P.detect_layout(mounts, own, v2_controllers, parent) == expected


@pytest.mark.parametrize("mounts, v2_controllers, says", [
    ("", "", "no cgroup2 mount"),
    (V2_MOUNTS, "cpu pids", "offers ['cpu', 'pids']"),
    ("cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n", "", "lacks ['memory']"),
])
def test_detect_layout_names_what_is_missing(mounts, v2_controllers, says):
    with pytest.raises(P.CgroupUnavailable, match="--cgroups off") as info:
        P.detect_layout(mounts, "0::/\n", v2_controllers)
    assert says in str(info.value)


def writes(layout, names, limits, **kw):
    return [(w.path, w.value) for w in P.plan_group(layout, names, limits, **kw)]


@pytest.mark.parametrize("layout, names, limits, kw, expected", [
    # v1: the agent's offer of 0.5 cpu and 4 GiB as hard limits; swap may not stretch memory
    (V1, ("torchrelay-agent-7",), P.agent_limits(0.5, 4 << 30), {"delegate": True}, [
        ("/sys/fs/cgroup/cpu/torchrelay-agent-7/cpu.cfs_period_us", "10000"),
        ("/sys/fs/cgroup/cpu/torchrelay-agent-7/cpu.cfs_quota_us", "5000"),
        ("/sys/fs/cgroup/memory/process_api/abc/torchrelay-agent-7/memory.limit_in_bytes", str(4 << 30)),
        ("/sys/fs/cgroup/memory/process_api/abc/torchrelay-agent-7/memory.memsw.limit_in_bytes", str(4 << 30))]),
    # v1 without swap accounting; an unknown memory offer (0) is no limit
    (V1, ("torchrelay-agent-7",), P.agent_limits(2, 0), {"swap_files": False}, [
        ("/sys/fs/cgroup/cpu/torchrelay-agent-7/cpu.cfs_period_us", "10000"),
        ("/sys/fs/cgroup/cpu/torchrelay-agent-7/cpu.cfs_quota_us", "20000")]),
    # v1: a launch of 2 workers granted 0.5 cpu and 1 GiB each -> weight of 1 cpu, 2 GiB hard
    (V1, ("torchrelay-agent-7", "job-1-a0-n0"), P.launch_limits(0.5, 1 << 30, 2), {"swap_files": False}, [
        ("/sys/fs/cgroup/cpu/torchrelay-agent-7/job-1-a0-n0/cpu.shares", "1024"),
        ("/sys/fs/cgroup/memory/process_api/abc/torchrelay-agent-7/job-1-a0-n0/memory.limit_in_bytes",
         str(2 << 30))]),
    # torchrun shares the group: its allowance comes on top of the workers' 2 x 1 GiB
    (V1, ("torchrelay-agent-7", "job-1-a0-n0"), P.launch_limits(0.5, 1 << 30, 2, launcher_process=True),
     {"swap_files": False}, [
        ("/sys/fs/cgroup/cpu/torchrelay-agent-7/job-1-a0-n0/cpu.shares", "1024"),
        ("/sys/fs/cgroup/memory/process_api/abc/torchrelay-agent-7/job-1-a0-n0/memory.limit_in_bytes",
         str((2 << 30) + P.LAUNCHER_ALLOWANCE))]),
    # a launch that asked for nothing gets no limits of its own (the agent's ceiling holds)
    (V1, ("a", "b"), P.launch_limits(0, 0, 3), {}, []),
    (V1, ("a", "b"), P.launch_limits(0, 0, 3, launcher_process=True), {}, []),
    # a quota under the kernel's smallest (1 ms) stretches the period instead, up to its largest (1 s)
    (V1, ("a",), P.Limits(cpus=0.05), {}, [("/sys/fs/cgroup/cpu/a/cpu.cfs_period_us", "20000"),
                                         ("/sys/fs/cgroup/cpu/a/cpu.cfs_quota_us", "1000")]),
    (V1, ("a",), P.Limits(cpus=0.001), {}, [("/sys/fs/cgroup/cpu/a/cpu.cfs_period_us", "1000000"),
                                          ("/sys/fs/cgroup/cpu/a/cpu.cfs_quota_us", "1000")]),
    (V1, ("a",), P.Limits(cpus=0.0001), {}, [("/sys/fs/cgroup/cpu/a/cpu.cfs_period_us", "1000000"),
                                           ("/sys/fs/cgroup/cpu/a/cpu.cfs_quota_us", "1000")]),
    # v2: the agent's group delegates cpu and memory to its launches (and its parent to it)
    (V2, ("torchrelay-agent-7",), P.agent_limits(1.5, 1 << 30), {"delegate": True}, [
        ("/sys/fs/cgroup/relay/cgroup.subtree_control", "+cpu +memory"),
        ("/sys/fs/cgroup/relay/torchrelay-agent-7/cgroup.subtree_control", "+cpu +memory"),
        ("/sys/fs/cgroup/relay/torchrelay-agent-7/cpu.max", "15000 10000"),
        ("/sys/fs/cgroup/relay/torchrelay-agent-7/memory.max", str(1 << 30)),
        ("/sys/fs/cgroup/relay/torchrelay-agent-7/memory.swap.max", "0")]),
    # v2 launch: weight from shares as runc converts them (1 cpu = 1024 shares = weight 39)
    (V2, ("torchrelay-agent-7", "l"), P.launch_limits(1, 512 << 20, 1), {"swap_files": False}, [
        ("/sys/fs/cgroup/relay/torchrelay-agent-7/l/cpu.weight", "39"),
        ("/sys/fs/cgroup/relay/torchrelay-agent-7/l/memory.max", str(512 << 20))]),
    (V2, ("a", "l"), P.Limits(cpu_weight=1000), {}, [("/sys/fs/cgroup/relay/a/l/cpu.weight", "10000")]),
])
def test_plan_group_table(layout, names, limits, kw, expected):
    assert writes(layout, names, limits, **kw) == expected


def test_group_dirs_and_procs_files():
    assert P.group_dirs(V1, "torchrelay-agent-7", "l") == (
        "/sys/fs/cgroup/cpu/torchrelay-agent-7/l", "/sys/fs/cgroup/memory/process_api/abc/torchrelay-agent-7/l")
    assert P.procs_files(V2, "a", "l") == ("/sys/fs/cgroup/relay/a/l/cgroup.procs",)


@pytest.mark.parametrize("launch_id, name", [
    ("job-1-a0-n0", "job-1-a0-n0"), ("a/b c", "a_b_c"), ("..", "launch_.."), ("", "launch_")])
def test_launch_group_name(launch_id, name):
    assert P.launch_group_name(launch_id) == name


@pytest.mark.parametrize("name, pid", [("torchrelay-agent-12", 12), ("torchrelay-agent-", None),
                                       ("torchrelay-agent-1x", None), ("other", None),
                                       ("torchrelay-agent-12-3", 12)])
def test_agent_pid_of(name, pid):
    assert P.agent_pid_of(name) == pid


def test_join_command_joins_every_group_then_execs():
    argv = P.join_command(("/a/cgroup.procs", "/b/cgroup.procs"), ["python", "-c", "print(1)"])
    assert argv[:2] == ["/bin/sh", "-c"]
    assert argv[3:] == ["relay-cgroup", "/a/cgroup.procs", "/b/cgroup.procs", "--", "python", "-c", "print(1)"]


@pytest.mark.parametrize("text, kills", [
    ("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", 3),  # v1 memory.oom_control
    ("low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n", 1),  # v2 memory.events
    ("oom_kill_disable 0\nunder_oom 0\n", 0),  # an old kernel does not count
    ("", 0),
])
def test_oom_kills_table(text, kills):
    assert P.oom_kills(text) == kills


@pytest.mark.parametrize("num, text", [(1 << 30, "1 GiB"), (3 << 29, "1.5 GiB"), (1000, "1000 B"),
                                       (100 << 20, "100 MiB"), (1536, "1.5 KiB"), (5 << 40, "5 TiB")])
def test_format_bytes(num, text):
    assert P.format_bytes(num) == text


@pytest.mark.parametrize("launch, agent, reason", [
    (1 << 30, 8 << 30, "memory limit 1 GiB exceeded"),
    (None, 8 << 30, "the node's memory offer 8 GiB exceeded"),
    (None, None, "out of memory (killed by the kernel's OOM killer)"),
])
def test_memory_reason(launch, agent, reason):
    assert P.memory_reason(launch, agent) == reason


@pytest.mark.parametrize("limits, granted", [
    (P.launch_limits(1, 1 << 30, 2), 2 << 30),
    (P.launch_limits(1, 1 << 30, 2, launcher_process=True), 2 << 30),  # the allowance is not the job's
    (P.launch_limits(1, 0, 2, launcher_process=True), None),
])
def test_the_granted_memory_is_what_the_job_asked_for(limits, granted):
    assert limits.granted_memory == granted
    if granted is not None:
        assert P.memory_reason(limits.granted_memory, None) == f"memory limit {P.format_bytes(granted)} exceeded"
