"""The scheduler on a real embedded cluster of 3 agents with different resources.

Nodes: ``agent-0`` (2 cpus, zone=a), ``agent-1`` (2 cpus, zone=b), both kind=cpu, and
``agent-2`` (2 cpus, 1 gpu, kind=gpu). One blocker per node (top priority, not preemptible)
holds them while a mixed queue is submitted: a 2-node gang at high priority, a job bound to
zone=b, a GPU job, and two jobs of a user whose quota allows one job at a time. Then the
blockers end (one node after another, in whatever order) and the test checks where and in what
order the jobs actually started, from their events. Jobs that must wait are held by files the
test creates, so no step depends on how fast the machine is.
"""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import pytest

from torchrelay.client.cluster import AgentOptions
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobState

pytestmark = pytest.mark.timeout(240)


def wait_for_file(path: Path) -> str:
    code = f"import os, time; [time.sleep(0.05) for _ in iter(lambda: os.path.exists({str(path)!r}), True)]"
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


def until(predicate, what: str, client: RelayClient, timeout: float = 90.0):
    """``predicate()`` once it is truthy; on timeout fails showing every job's events."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            jobs = [client.job(j.id) for j in client.jobs(limit=100)]
            shown = "\n".join(f"{j.name} {j.state.value} {j.waiting_reason!r} "
                              f"{[(p.node_name, p.workers) for p in j.placement]} "
                              f"{[(e.state.value, e.message) for e in j.events]}" for j in jobs)
            pytest.fail(f"timed out waiting for {what}:\n{shown}")
        time.sleep(0.1)


def scheduled_at(info) -> float:
    """Server time the job's (first) attempt was placed."""
    return next(e.time for e in info.events if e.state == JobState.SCHEDULED)


def test_mixed_queue_runs_in_policy_order(cluster_factory, tmp_path):
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text("capped: {jobs: 1}\n")
    cluster = cluster_factory(3, quotas_file=quotas, heartbeat_timeout_s=30, agent_options=[
        AgentOptions(cpus=2, memory="4GiB", labels={"zone": "a", "kind": "cpu"}),
        AgentOptions(cpus=2, memory="4GiB", labels={"zone": "b", "kind": "cpu"}),
        AgentOptions(cpus=2, gpus=1, gpu_type="h100", memory="4GiB", labels={"kind": "gpu"}),
    ])
    release_blockers, release_capped = tmp_path / "release-blockers", tmp_path / "release-capped"
    noop = f"{shlex.quote(sys.executable)} -c pass"

    def job(name: str, user: str, entrypoint: str = noop, **kw) -> dict:
        return {"name": name, "user": user, "entrypoint": entrypoint, **({"workers": 1} | kw)}

    with RelayClient(cluster.address) as c:
        nodes = {n.name: n for n in c.nodes()}
        # the agent adds what it detects (relay.mpirun when Open MPI is installed) to the labels it was given
        given = {k: v for k, v in nodes["agent-0"].labels.items() if not k.startswith("relay.")}
        assert (nodes["agent-2"].gpus, given) == (1, {"zone": "a", "kind": "cpu"})
        assert (nodes["agent-2"].gpu_type, nodes["agent-0"].gpu_type) == ("h100", None)  # relay agent --gpu-type
        # one blocker per node, top priority and not preemptible, until the test says so
        blockers = [c.submit(job(f"blocker-{i}", "ops", wait_for_file(release_blockers), workers=2, labels=labels,
                                 priority=100, preemptible=False), upload=False)
                    for i, labels in enumerate(({"zone": "a"}, {"zone": "b"}, {"kind": "gpu"}))]
        until(lambda: all(c.job(b.id).state == JobState.RUNNING for b in blockers), "the blockers to run", c)
        assert {n.name: n.used_cpus for n in c.nodes()} == {"agent-0": 2, "agent-1": 2, "agent-2": 2}

        zone_b = c.submit(job("zone-b", "u1", workers=2, labels={"zone": "b"}), upload=False)
        gang = c.submit(job("gang", "u2", nodes=2, workers_per_node=2, workers=4, priority=10,
                            labels={"kind": "cpu"}), upload=False)
        capped1 = c.submit(job("capped1", "capped", wait_for_file(release_capped), priority=5), upload=False)
        capped2 = c.submit(job("capped2", "capped", priority=5), upload=False)
        gpu = c.submit(job("gpu", "u3", resources={"cpu": 1, "gpu": 1, "gpu_type": "h100"}), upload=False)
        ids = [zone_b.id, gang.id, capped1.id, capped2.id, gpu.id]
        until(lambda: all(c.job(i).waiting_reason for i in ids), "waiting reasons", c, timeout=30)
        view = c.queue()
        assert [r["id"] for r in view][:1] == [gang.id]  # highest priority first
        assert all(r["reason"] for r in view)

        released_at = time.time()
        release_blockers.touch()
        until(lambda: c.job(capped1.id).state == JobState.RUNNING, "capped1 to run", c)
        # capped1 holds the user's one job: capped2 waits on the quota although room is free
        reason = until(lambda: (c.job(capped2.id).waiting_reason or "").startswith("quota")
                       and c.job(capped2.id).waiting_reason, "capped2 to wait on its quota", c)
        assert "capped" in reason and "jobs" in reason
        assert c.job(capped2.id).state == JobState.QUEUED
        release_capped.touch()

        final = {i: c.wait(i, timeout=120, poll_s=0.2) for i in ids}
        assert all(info.state == JobState.SUCCEEDED for info in final.values()), {
            i: (f.state, f.failure) for i, f in final.items()}
        for b in blockers:
            c.wait(b.id, timeout=60, poll_s=0.2)

    at = {i: scheduled_at(final[i]) for i in ids}
    # the blockers' nodes free one by one; whatever the order, the policy's rules decide:
    assert min(at.values()) >= released_at
    assert sorted(p.node_name for p in final[gang.id].placement) == ["agent-0", "agent-1"]  # whole gang
    assert [(p.node_name, p.workers) for p in final[zone_b.id].placement] == [("agent-1", 2)]  # its label
    assert [p.node_name for p in final[gpu.id].placement] == ["agent-2"]  # the one GPU
    # the gang (priority 10) holds a reservation on agent-0/1: zone-b (priority 0, no declared
    # runtime) may not take agent-1 before it, even when agent-1 frees first (the gang's own
    # launch on agent-1 may end a moment before the job's last launch, so compare with its start)
    assert at[gang.id] < at[zone_b.id] and at[zone_b.id] > final[gang.id].started_at
    # capped2 waits for its user's one running job (quota), although agent-2 has room
    assert at[capped2.id] >= final[capped1.id].finished_at
    assert [p.node_name for p in final[capped1.id].placement] == ["agent-2"]  # agent-0/1 are reserved
