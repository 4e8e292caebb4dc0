"""The scheduler's elastic range on a real embedded cluster (one agent of 3 cpus for the module,
warm launches, gloo on 127.0.0.1), with ``tests/jobs/elastic/train.py`` (3 workers, min 2): it
starts with its min_workers when the cluster is short; and a higher-priority job takes one of
its workers, the job going on smaller (its other ranks keep their pids) instead of being
requeued, and grows back to its workers when that job ended: the platform starts a joiner,
which receives the members' state."""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch

from torchrelay.client.cluster import AgentOptions
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobState

pytestmark = pytest.mark.timeout(180)
JOB = Path(__file__).resolve().parents[1] / "jobs" / "elastic"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from conftest import group_members
    from torchrelay.client.cluster import start_cluster, stop_cluster

    cluster = start_cluster(1, home=tmp_path_factory.mktemp("elastic-home"), agent_options=[AgentOptions(cpus=3)])
    try:
        yield cluster
    finally:
        stop_cluster(cluster.home)
        for pid in cluster.pids:
            assert group_members(pid) == [], f"processes left in group {pid}"


def elastic_job(out: Path, workers: int, epochs: int, more: str = "") -> dict:
    return {"name": "elastic", "workers": workers, "resources": {"cpu": 1},
            "entrypoint": f"python train.py --epochs {epochs} --step-sleep 0.02{more}", "env": {"OUT": str(out)},
            "strategy": {"kind": "ddp", "elastic": {"min_workers": 2, "max_workers": 4}}}


def lines(out: Path, member: int) -> list[dict]:
    path = out / f"member-{member}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def until(predicate, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def messages(info) -> list[str]:
    return [e.message for e in info.events]


def test_an_elastic_job_starts_with_its_min_workers_when_the_cluster_is_short(cluster, tmp_path):
    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    hold = f"import os, time; [time.sleep(0.05) for _ in iter(lambda: os.path.exists({str(release)!r}), True)]"
    with RelayClient(cluster.address) as c:
        blocker = c.submit({"name": "blocker", "workers": 1, "resources": {"cpu": 1}, "preemptible": False,
                            "entrypoint": f"{shlex.quote(sys.executable)} -c {shlex.quote(hold)}"}, upload=False)
        until(lambda: c.job(blocker.id).state == JobState.RUNNING, "the blocker to run")
        job = c.submit(elastic_job(out, 3, epochs=1), base_dir=JOB)  # 3 asked, room for 2
        info = c.wait(job.id, timeout=120, poll_s=0.2)
        release.touch()
        assert c.wait(blocker.id, timeout=60, poll_s=0.2).state == JobState.SUCCEEDED
    assert info.state == JobState.SUCCEEDED, messages(info)
    assert any(m.startswith("placed on agent-0×2 (elastic: 2 of 3 workers") for m in messages(info)), messages(info)
    assert [p.workers for p in info.placement] == [2]
    assert lines(out, 0)[-1]["members"] == [0, 1] and not lines(out, 2)


def test_a_higher_priority_job_shrinks_an_elastic_job_which_grows_back_when_it_ends(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with RelayClient(cluster.address) as c:
        # 96 steps; at step 48 the members wait until a joiner registered (it comes once urgent ended)
        elastic = c.submit(elastic_job(out, 3, epochs=12, more=" --hold-at 48"), base_dir=JOB)
        until(lambda: all(len(lines(out, m)) >= 3 for m in range(3)), "the 3 members to train")
        urgent = c.submit({"name": "urgent", "workers": 1, "priority": 10, "resources": {"cpu": 1},
                           "entrypoint": f"{shlex.quote(sys.executable)} -c pass"}, upload=False)
        assert c.wait(urgent.id, timeout=60, poll_s=0.2).state == JobState.SUCCEEDED
        info = c.wait(elastic.id, timeout=120, poll_s=0.2)
    assert info.state == JobState.SUCCEEDED, messages(info)
    assert (info.attempt, info.restarts) == (1, 0)  # never stopped, never requeued
    assert not any("requeued" in m or "preempt" in m for m in messages(info)), messages(info)
    changes = [m for m in messages(info) if m.startswith(("shrinking", "growing"))]
    assert changes == [f"shrinking for higher-priority job {urgent.id}: rank(s) 2 leave (agent-0×1); "
                       f"elastic: 3 → 2 workers",
                       "growing: rank(s) 3 join (agent-0×1) and receive the members' state; elastic: 2 → 3 workers"
                       ], messages(info)
    for member in (0, 1, 3):
        seen = lines(out, member)
        assert len({x["pid"] for x in seen}) == 1, f"member {member} restarted"  # the same process throughout
        assert seen[-1]["step"] == 95 and seen[-1]["members"] == [0, 1, 3]
    assert lines(out, 2)[-1]["step"] < 48  # the released rank left mid-run; the joiner came after
    joined = json.loads((out / "history-3.json").read_text())[0]["epoch"]
    received = torch.load(out / f"after-sync-{joined}-3.pt")
    sent = torch.load(out / f"before-sync-{joined}-0.pt")  # member 0 is the source
    assert received["steps_done"] == sent["steps_done"] == lines(out, 3)[0]["step"]
    for key, value in sent["model"].items():
        assert torch.equal(received["model"][key], value), key
    final = [torch.load(out / f"final-{m}.pt") for m in (0, 1, 3)]
    assert all(torch.equal(f[k], final[0][k]) for f in final for k in final[0])
