"""Two servers on one PostgreSQL: one leads, the other answers where it is; the leader killed
(-9) mid-job: the other leads, the running workers run on through the takeover (their agent
keeps its launches while it looks for a leader), and no job, log line or metric is lost."""
from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest

import chaos
from conftest import kill_group
from test_store_durability import CLI, JOBS, Server
from torchrelay.client.sdk import RelayClient
from torchrelay.errors import Conflict
from torchrelay.spec import JobSpec, JobState

pytestmark = pytest.mark.timeout(300)


def role(address: str) -> str | None:
    try:
        return httpx.get(f"{address}/api/v1/health", timeout=5).headers.get("x-relay-role")
    except httpx.HTTPError:
        return None


@pytest.fixture
def pair(tmp_path, postgres, monkeypatch):
    name = f"failover_{os.getpid()}_{time.monotonic_ns()}"
    postgres.create_database(name)
    store = str(tmp_path / "store")  # what every server of the cluster reaches (S3 across hosts)
    servers = []
    for label in ("a", "b"):
        home = tmp_path / label
        home.mkdir()
        servers.append(Server(home, postgres.url_of(name), "--store", store))
    monkeypatch.setenv("RELAY_HOME", str(tmp_path))  # chaos finds only this test's processes
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
        postgres.drop_database(name)


def test_one_leads_the_other_names_it_and_the_clients_follow(pair):
    a, b = pair
    first = a.start()
    chaos.wait_until(lambda: role(first) == "leader", 30, "the first server to lead")
    second = b.start()
    assert role(second) == "follower"
    with RelayClient(second) as only_follower:  # a client given the follower alone is told where to go
        assert only_follower.nodes() == [] and only_follower.address == first
    reply = httpx.get(f"{second}/api/v1/jobs", timeout=5)
    assert reply.status_code == 503 and reply.json()["error"] == "NotLeader" and reply.json()["leader"] == first
    assert first in reply.json()["detail"]


def test_the_leader_killed_mid_job_the_other_takes_over_and_nothing_is_lost(pair, tmp_path):
    a, b = pair
    first = a.start()
    chaos.wait_until(lambda: role(first) == "leader", 30, "the first server to lead")
    second = b.start()
    both = f"{first},{second}"
    log = open(tmp_path / "agent.log", "ab")
    agent = subprocess.Popen([*CLI, "agent", "--address", both, "--name", "a0", "--cpus", "1",
                              "--work-dir", str(tmp_path / "a0")], env={**os.environ, "RELAY_HOME": str(tmp_path)},
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        with RelayClient(both) as c:
            c.wait_for_nodes(1, timeout=60)
            job = c.submit(JobSpec.parse({"name": "counted", "entrypoint": "python counter.py 80"}), base_dir=JOBS)
            chaos.wait_until(lambda: len(list(c.iter_logs(job.id))) >= 10, 120, "ten log lines")
            a.kill()
            chaos.wait_until(lambda: role(second) == "leader", 60, "the second server to lead")
            final = c.wait(job.id, timeout=180)
            assert c.address == second
            # attempt 1 to the end: the workers that started the job finished it, through the takeover
            assert (final.state, final.attempt, final.restarts) == (JobState.SUCCEEDED, 1, 0), (final.failure,
                                                                                                 final.events)
            assert [line.text for line in c.iter_logs(job.id)] == [f"line {i}" for i in range(80)]
            assert sorted(p.step for p in c.iter_metrics(job.id)) == list(range(80))
            node = c.nodes()[0]
            assert node.state == "READY"
    finally:
        kill_group(agent.pid)
        agent.wait(timeout=15)


@pytest.mark.slow
def test_two_servers_on_two_databases_named_as_one_cluster_are_refused(pair, postgres):
    a, b = pair
    other = f"other_{os.getpid()}_{time.monotonic_ns()}"
    postgres.create_database(other)
    try:
        b.db_url = postgres.url_of(other)  # its own database: a second cluster, leading too
        first, second = a.start(), b.start()
        chaos.wait_until(lambda: role(first) == role(second) == "leader", 30, "both servers to lead")
        with RelayClient(f"{first},{second}") as c:
            assert c.nodes() == []
            a.kill()
            with pytest.raises(Conflict, match=rf"{second} serves cluster \w+ but {first} serves cluster \w+"):
                c.nodes()
    finally:
        b.stop()
        postgres.drop_database(other)
