"""An agent's cgroup limits on real processes (root and the cgroup controllers needed).

A launch on an agent offering 0.5 cpu gets half a CPU, whatever the machine's load (the quota
is a ceiling: load only lowers what it gets); a launch over its memory is killed by the
kernel in its own group and says so ("memory limit 1 GiB exceeded"); no group is left after
a launch, however it ended, nor after the agent.
"""
from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from torchrelay import wire
from torchrelay.agent import cgroups
from torchrelay.agent.backends import BackendKind
from torchrelay.agent import cgroup_plan
from torchrelay.agent.launcher import Launch, has_launcher_process, pick_free_port
from torchrelay.agent.zygote import Zygote

USABLE, WHY_NOT = cgroups.cgroups_usable()
pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not USABLE, reason=WHY_NOT)]

BUSY = """
import json, os, time
t0, c0 = time.monotonic(), time.process_time()
n = 0
while time.monotonic() - t0 < float(os.environ["BUSY_S"]):
    for _ in range(2000):
        n += 1
print("RESULT " + json.dumps({"wall": time.monotonic() - t0, "cpu": time.process_time() - c0, "n": n}))
"""

HOG = """
import sys
hold = b"x" * (int(sys.argv[1]) << 20)  # filled: every page is charged
print("survived", len(hold))
"""


@pytest.fixture
def agent_groups():
    opened = []

    def make(cpus: float, memory: int = 0) -> cgroups.AgentCgroups:
        group = cgroups.AgentCgroups.open(cpus=cpus, memory=memory)
        opened.append(group)
        return group

    yield make
    for group in opened:
        group.close()
        assert not any(os.path.exists(d) for d in group.dirs), "the agent's cgroup was left behind"


def make_launch(tmp_path: Path, name: str, script: str, args: list[str], group: cgroups.AgentCgroups, *,
                cpu: float = 0.0, memory: int = 0, zygote: Zygote | None = None, nproc: int = 1,
                env: dict | None = None, entrypoint: list[str] | None = None) -> Launch:
    code = tmp_path / name / "code"
    code.mkdir(parents=True)
    (code / "job.py").write_text(textwrap.dedent(script))
    assignment = wire.LaunchAssignment(
        launch_id=f"cg-{name}-{os.getpid()}-{time.monotonic_ns()}", job_id="job-1", attempt=0, desired="run",
        node_rank=0, nnodes=1, nproc_per_node=nproc, world_size=nproc, rank_offset=0,
        entrypoint=entrypoint or ["python", "job.py", *args], bundle=None, env=env or {}, store_url=str(tmp_path / "store"),
        job_store_prefix="jobs/job-1", cpu=cpu, memory=memory)
    cgroup = group.launch(assignment.launch_id, cpu_per_worker=cpu, memory_per_worker=memory, workers=nproc,
                          launcher_process=has_launcher_process(assignment, zygote))
    return Launch(assignment, code_dir=code, run_dir=tmp_path / name / "run",
                  relay_address="http://127.0.0.1:9", zygote=zygote, cgroup=cgroup)


def rank_result(launch: Launch) -> dict:
    text = (launch.run_dir / "logs" / "rank-0.log").read_text()
    line = next(x for x in text.splitlines() if "RESULT " in x)
    return json.loads(line.split("RESULT ", 1)[1])


def throttled_periods(cgroup: cgroups.LaunchCgroup | cgroups.AgentCgroups) -> int:
    """``nr_throttled`` of the agent's group (v1 cpu.stat; v2 cpu.stat too)."""
    text = Path(cgroup.dirs[0], "cpu.stat").read_text()
    return int(dict(line.split() for line in text.splitlines())["nr_throttled"])


def test_a_half_cpu_offer_is_a_half_cpu_ceiling(tmp_path, agent_groups, launches):
    """Two agents offering 1 and 0.5 cpu run the same busy loop side by side: neither uses
    more CPU per second of wall time than its offer (the quota is a ceiling: the machine's
    load can only lower what a launch gets, so this holds on a busy machine too), and when the
    machine let the whole one run faster than half a CPU, the half one was throttled. The 2:1
    throughput itself is measured in ``bench/hetero.py``, not asserted here."""
    whole, half = agent_groups(1.0), agent_groups(0.5)
    assert Path(half.dirs[0], "cpu.cfs_quota_us" if half.layout.version == 1 else "cpu.max").read_text() \
        .split()[0] == "5000"
    env = {"BUSY_S": "2.0"}
    runs = {g: make_launch(tmp_path, name, BUSY, [], g, cpu=0.5, env=env)
            for name, g in (("whole", whole), ("half", half))}
    for launch in runs.values():
        launches.append(launch)
        launch.start("127.0.0.1", pick_free_port())
    for launch in runs.values():
        status = launch.wait(60)
        assert status is not None and status.succeeded, status
    got = {g: rank_result(launch) for g, launch in runs.items()}
    share = {g: r["cpu"] / r["wall"] for g, r in got.items()}
    rate = {g: r["n"] / r["wall"] for g, r in got.items()}
    print(f"cpu share whole {share[whole]:.2f} half {share[half]:.2f}; "
          f"throughput half/whole {rate[half] / rate[whole]:.2f}; load {os.getloadavg()[0]:.1f}")
    assert share[half] <= 0.5 + 0.06  # one period's slack over 2 s
    assert share[whole] <= 1.0 + 0.06
    if share[whole] > 0.6:
        assert throttled_periods(half) > 0


@pytest.mark.parametrize("mode", ["fresh", "forked"])
def test_a_launch_over_its_memory_is_stopped_with_the_reason(tmp_path, agent_groups, launches, mode):
    """1 GiB granted, 1.2 GiB touched: the kernel kills the worker in the launch's own group,
    not the agent or the node, and the launch says 'memory limit 1 GiB exceeded'."""
    group = agent_groups(2.0)
    zygote = Zygote(env={**os.environ, "PYTHONUNBUFFERED": "1"}) if mode == "forked" else None
    try:
        launch = make_launch(tmp_path, "hog", HOG, ["1200"], group, memory=1 << 30, zygote=zygote)
        assert launch.kind is (BackendKind.ZYGOTE if zygote else BackendKind.DIRECT)
        launches.append(launch)
        launch.start("127.0.0.1", pick_free_port())
        status = launch.wait(60)
    finally:
        if zygote is not None:
            zygote.close()
    assert status is not None and not status.succeeded
    assert launch.forked is (mode == "forked")
    (rank,) = status.ranks
    assert (rank.signal, rank.reason) == (9, "memory limit 1 GiB exceeded")
    assert status.message == "rank 0: memory limit 1 GiB exceeded (signal 9, SIGKILL)"
    assert "survived" not in (launch.run_dir / "logs" / "rank-0.log").read_text()
    assert not any(os.path.exists(d) for d in launch.cgroup.dirs)


def test_under_its_memory_a_launch_succeeds_and_torchrun_ranks_are_limited_too(tmp_path, agent_groups, launches):
    """Two ranks under torchrun, 512 MiB each: the launch's group holds 1 GiB and torchrun's
    own allowance, so both fit."""
    group = agent_groups(2.0)
    launch = make_launch(tmp_path, "fits", HOG, ["64"], group, memory=512 << 20, nproc=2)
    assert launch.kind is BackendKind.TORCHRUN
    launches.append(launch)
    launch.start("127.0.0.1", pick_free_port())
    limit = Path(launch.cgroup.dirs[-1], "memory.limit_in_bytes" if group.layout.version == 1 else "memory.max")
    assert limit.read_text().strip() == str((1 << 30) + cgroup_plan.LAUNCHER_ALLOWANCE)
    status = launch.wait(60)
    assert status is not None and status.succeeded, status.message
    assert not any(os.path.exists(d) for d in launch.cgroup.dirs)


def test_no_cgroup_is_left_after_a_launch_however_it_ended(tmp_path, agent_groups, launches):
    """Succeeded, stopped, could not start: every launch's group is gone afterwards, and a
    process the launch left in it (its tag dropped) is ended with it."""
    group = agent_groups(2.0)
    ok = make_launch(tmp_path, "ok", "print('hi')", [], group)
    stopped = make_launch(tmp_path, "stopped", "import time; time.sleep(60)", [], group)
    unstartable = make_launch(tmp_path, "bad", "", [], group, entrypoint=["/nonexistent/program"])
    for launch in (ok, stopped, unstartable):
        launches.append(launch)
        launch.start("127.0.0.1", pick_free_port())
    assert ok.wait(30).succeeded
    assert stopped.cgroup.members(), "the sleeping worker runs in its launch's group"
    assert stopped.stop(grace_s=2).stopped
    bad = unstartable.wait(30)
    assert bad is not None and not bad.succeeded
    for launch in (ok, stopped, unstartable):
        assert not any(os.path.exists(d) for d in launch.cgroup.dirs), launch.launch_id
    assert [p.name for d in group.dirs for p in Path(d).iterdir() if p.is_dir()] == []


def test_a_dead_agents_groups_are_swept_by_the_next(tmp_path):
    """An agent killed before ``close`` leaves its group (and maybe processes in it); the next
    agent on the machine removes it and ends them."""
    import subprocess
    import sys
    code = ("import time; from torchrelay.agent import cgroups; g = cgroups.AgentCgroups.open(cpus=1, memory=0); "
            "c = g.launch('x', cpu_per_worker=1, memory_per_worker=0, workers=1); c.create(); "
            "print(' '.join(c.dirs), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        dirs = proc.stdout.readline().split()
        assert dirs and all(os.path.isdir(d) for d in dirs)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert all(os.path.isdir(d) for d in dirs)  # left behind by a killed agent
    assert cgroups.sweep_dead_agents(cgroups.detect()) >= 1
    assert not any(os.path.exists(d) for d in dirs)
    assert not any(os.path.exists(os.path.dirname(d)) for d in dirs)


def test_a_job_over_its_memory_restarts_then_fails_with_the_reason(cluster_factory, tmp_path):
    """Through the platform: the job's spec allows one restart, so the attempt killed over its
    memory is restarted once, then the job fails, and the user reads the reason."""
    from torchrelay.client.sdk import RelayClient
    from torchrelay.spec import JobSpec, JobState

    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "hog.py").write_text(textwrap.dedent(HOG))
    cluster = cluster_factory(1)
    with RelayClient(cluster.address) as client:
        spec = JobSpec.parse({"name": "hog", "entrypoint": "python hog.py 1200", "workers": 1,
                              "resources": {"cpu": 1, "memory": "1GiB"}, "max_restarts": 1})
        info = client.submit(spec, base_dir=tmp_path / "job")
        final = client.wait(info.id, timeout=120)
    assert final.state == JobState.FAILED, final
    assert final.failure.reason == "rank 0 was stopped: memory limit 1 GiB exceeded (signal 9)"
    assert final.restarts == 1
    assert any("memory limit 1 GiB exceeded" in (e.message or "") for e in final.events
               if e.state == JobState.RESTARTING)


def test_an_agent_without_usable_cgroups_runs_unlimited_in_auto_and_refuses_in_on(tmp_path, monkeypatch):
    """A hierarchy that refuses (here: the parent is a plain file) is a warning under "auto"
    (the agent runs, without limits) and an error under "on"."""
    from torchrelay.agent.daemon import Agent

    nowhere = str(tmp_path / "no-hierarchy")  # nothing to sweep there
    monkeypatch.setattr(cgroups, "detect", lambda parent=None: cgroups.plan.Layout(
        1, (("cpu", nowhere), ("memory", nowhere))))
    tmp_file = tmp_path / "file"
    tmp_file.write_text("")
    monkeypatch.setattr(cgroups.plan, "group_dirs", lambda layout, *names: (str(tmp_file / "x"),))
    auto = Agent("http://127.0.0.1:9", name="n", cpus=1, gpus=0, memory=2**30, work_dir=tmp_path / "a",
                 cgroups="auto")
    auto._open_cgroups()
    assert auto.cgroups is None
    auto.server.close()
    strict = Agent("http://127.0.0.1:9", name="n", cpus=1, gpus=0, memory=2**30, work_dir=tmp_path / "b",
                   cgroups="on")
    with pytest.raises(cgroups.CgroupError, match="cannot create cgroup"):
        strict._open_cgroups()
    strict.server.close()
    with pytest.raises(ValueError, match="cgroups 'sometimes' is not one of auto, on, off"):
        Agent("http://127.0.0.1:9", name="n", cpus=1, gpus=0, memory=2**30, work_dir=tmp_path / "c",
              cgroups="sometimes")
