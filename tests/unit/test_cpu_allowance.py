"""A process's CPU allowance: the cgroup path parsed from /proc's text (tables), each quota's
text, and, as root, a real cgroup with a quota above the process's own (removed after)."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from torchrelay.train.cpu_allowance import cpu_dirs, quota_cpus

V1_MOUNTS = """cgroup /sys/fs/cgroup/cpu cgroup rw,nosuid,nodev,noexec,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0
"""
V1_JOINT = "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,relatime,cpu,cpuacct 0 0\n"
V2_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
CPUACCT_ONLY = "cgroup /sys/fs/cgroup/cpuacct cgroup rw,cpuacct 0 0\n"


@pytest.mark.parametrize("self_cgroup, mounts, expected", [
    ("1:cpu:/torchrelay-agent-7/launch-a\n2:memory:/x\n", V1_MOUNTS,
     (1, ["/sys/fs/cgroup/cpu/torchrelay-agent-7/launch-a", "/sys/fs/cgroup/cpu/torchrelay-agent-7",
          "/sys/fs/cgroup/cpu"])),
    ("3:cpu,cpuacct:/a\n", V1_JOINT, (1, ["/sys/fs/cgroup/cpu,cpuacct/a", "/sys/fs/cgroup/cpu,cpuacct"])),
    ("1:cpu:/\n", V1_MOUNTS, (1, ["/sys/fs/cgroup/cpu"])),                    # the root: itself only
    ("0::/user.slice/job\n", V2_MOUNTS, (2, ["/sys/fs/cgroup/user.slice/job", "/sys/fs/cgroup/user.slice",
                                            "/sys/fs/cgroup"])),
    ("1:cpu:/a\n0::/b\n", V1_MOUNTS + V2_MOUNTS, (1, ["/sys/fs/cgroup/cpu/a", "/sys/fs/cgroup/cpu"])),  # hybrid: v1
    ("2:cpuacct:/a\n", CPUACCT_ONLY, None),                                 # cpuacct is not cpu
    ("0::/a\n", "", None),                                                  # nothing mounted
    ("", V1_MOUNTS, None),                                                  # in no cgroup at all
])
def test_the_path_from_the_process_cgroup_up_to_the_root(self_cgroup, mounts, expected):
    assert cpu_dirs(self_cgroup, mounts) == expected


@pytest.mark.parametrize("version, texts, cpus", [
    (1, ("50000\n", "100000\n"), 0.5),
    (1, ("5000", "10000"), 0.5),
    (1, ("150000", "100000"), 1.5),
    (1, ("-1", "100000"), None),          # no quota
    (1, ("x", "100000"), None),           # not a number
    (2, ("max 100000\n",), None),
    (2, ("25000 100000\n",), 0.25),
    (2, ("200000",), 2.0),                # the period left out: the kernel's 100 ms
    (2, ("",), None),
])
def test_a_quota_in_cpus(version, texts, cpus):
    assert quota_cpus(version, texts) == cpus


def _v1_cpu_mount() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup" and "cpu" in fields[3].split(","):
            return Path(fields[1])
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="making a cgroup needs root")
def test_a_quota_above_the_process_caps_it(tmp_path):
    mount = _v1_cpu_mount()
    if mount is None:
        pytest.skip("no cgroup v1 hierarchy with the cpu controller here")
    parent = mount / f"torchrelay-test-{uuid.uuid4().hex[:8]}"
    child = parent / "launch"
    try:
        child.mkdir(parents=True)
        (parent / "cpu.cfs_period_us").write_text("10000")
        (parent / "cpu.cfs_quota_us").write_text("5000")  # 0.5 cpu on the parent; none on the child
        probe = ("import os, sys, torch; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid())); "
                 "torch.set_num_threads(int(sys.argv[2])); "
                 "from torchrelay.train.cpu_allowance import cpu_allowance; print(cpu_allowance())")
        limited = subprocess.run([sys.executable, "-c", probe, str(child), "4"], capture_output=True, text=True,
                                 check=True)
        assert float(limited.stdout) == 0.5
        (parent / "cpu.cfs_quota_us").write_text("-1")
        one_thread = subprocess.run([sys.executable, "-c", probe, str(child), "1"], capture_output=True, text=True,
                                    check=True)
        assert float(one_thread.stdout) == 1.0  # no quota: its one thread
    finally:
        for group in (child, parent):
            if group.exists():
                group.rmdir()  # the probes have exited, so the groups are empty
