"""Jobs across test hosts: a server on one network namespace, agents on three others.

One set of hosts and one cluster serve the whole module (``tests/host_cluster.py``); each
test leaves the cluster as it found it (every node READY, nothing running). Each agent is
started without ``--host``: it advertises its address on the route to the server. The job
scripts are the ones other tests run on one host; here they cross a network whose host name
resolves to loopback, which is what failed before the launch pinned the interface
(docs/design.md, gloo and host addresses).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import chaos
from test_fault_tolerance import reference_model  # noqa: F401 - a fixture this module uses
from tests.host_cluster import CLI, HostCluster
from tests.hosts import TestHosts
from torchrelay.client.sdk import RelayClient
from torchrelay.errors import Unschedulable
from torchrelay.spec import JobSpec, JobState

pytestmark = [pytest.mark.skipif(TestHosts.unavailable() is not None, reason=TestHosts.unavailable() or ""),
              pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "jobs"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts")
    with pytest.MonkeyPatch.context() as patch, TestHosts(4) as hosts:
        patch.setenv("RELAY_HOME", str(root))  # chaos finds only this cluster's processes
        made = HostCluster(hosts, root)
        with RelayClient(made.address) as c:
            c.wait_for_nodes(3, timeout=120)
        yield made


@pytest.fixture
def client(cluster):
    with RelayClient(cluster.address) as c:
        yield c
        # the next test finds every node READY and idle
        names = {host.name for host in cluster.agent_hosts}
        chaos.wait_until(lambda: all(n.state == "READY" and not n.launches for n in c.nodes() if n.name in names),
                         120, "every node READY and idle")


def describe(c: RelayClient, job_id: str) -> str:
    info = c.job(job_id)
    events = "\n  ".join(f"{e.state.value}: {e.message}" for e in info.events)
    return f"{info.id} {info.state.value} failure {info.failure}\n  {events}\nnodes {c.nodes()}"


def test_agents_advertise_their_address_on_the_route_to_the_server(cluster, client):
    nodes = {n.name: n for n in client.nodes()}
    for host in cluster.agent_hosts:
        assert nodes[host.name].address == host.address
        assert nodes[host.name].problem is None
        assert f"advertising {host.address} (interface {host.ifname}" in cluster.agent_log(host)


def test_an_address_on_none_of_the_hosts_interfaces_is_refused_at_start(cluster):
    host = cluster.agent_hosts[0]
    done = subprocess.run(["ip", "netns", "exec", host.name, *CLI, "agent", "--address", cluster.address,
                           "--host", "10.253.253.253", "--work-dir", str(cluster.root / "refused")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    message = " ".join(done.stderr.split())
    assert "'10.253.253.253' is on none of this host's interfaces" in message, message
    assert f"{host.ifname} {host.address}" in message and "lo 127.0.0.1" in message


def test_an_agent_other_hosts_cannot_reach_is_reported_and_gets_no_work(cluster, client):
    host = cluster.agent_hosts[2]
    hidden = "192.168.231.7"  # held by the host, but no other host has a route to it
    subprocess.run(["ip", "netns", "exec", host.name, "ip", "addr", "add", f"{hidden}/24", "dev", host.ifname],
                   check=True)
    agent = cluster.hosts.popen(host, [*CLI, "agent", "--address", cluster.address, "--name", "hidden",
                                       "--host", hidden, "--cpus", "8", "--work-dir", str(cluster.root / "hidden")],
                                stdout=open(cluster.root / "hidden.log", "ab"), stderr=subprocess.STDOUT)
    try:
        try:
            node = chaos.wait_until(lambda: {n.name: n for n in client.nodes()}.get("hidden"), 60, "the node 'hidden'")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {(cluster.root / 'hidden.log').read_text()[-3000:]}") from None
        assert node.state == "READY" and node.problem and node.problem.startswith("unreachable"), node
        assert f"{hidden}:" in node.problem
        shown = subprocess.run([*CLI, "nodes"], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "RELAY_ADDRESS": cluster.address, "COLUMNS": "300"})
        assert "READY (unreachable)" in shown.stdout and "hidden" in shown.stdout, shown.stdout
        assert re.search(r"hidden \(node-\w+\) gets no work: unreachable", " ".join(shown.stdout.split()))
        # a job that only the hidden node could hold waits; it is never placed there
        # a job only the hidden node could hold is refused: no node that can hold it is ready
        with pytest.raises(Unschedulable, match="3 ready node"):
            client.submit(JobSpec.parse({"name": "big", "entrypoint": "python counter.py 1", "workers": 1,
                                         "resources": {"cpu": 6}}), base_dir=JOBS / "plain")
    finally:
        agent.terminate()
        agent.wait(timeout=30)
        subprocess.run(["ip", "netns", "exec", host.name, "ip", "addr", "del", f"{hidden}/24", "dev", host.ifname])


def test_ddp_on_two_hosts_of_two_workers_equals_one_process_on_the_4x_batch(cluster, client, tmp_path):
    from tests.integration import test_train_ddp as case

    import torchrelay.train as rt

    spec = JobSpec.parse({"name": "ddp-2x2", "nodes": 2, "workers_per_node": 2, "resources": {"cpu": 1},
                          # an absolute path: the hosts share this file system, and the worker finds the model beside it
                          "entrypoint": f"python {case.__file__} --worker {tmp_path}"})
    (tmp_path / "code").mkdir()
    job = client.submit(spec, base_dir=tmp_path / "code")
    final = client.wait(job.id, timeout=240)
    assert final.state == JobState.SUCCEEDED, describe(client, job.id)
    assert len({p.node_name for p in final.placement}) == 2, final.placement

    ranks = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in range(4)]
    n = len(case._dataset())
    shares = [rt.shard_indices(n, rank=r, world_size=4, shuffle=True, seed=case.SEED, epoch=case.EPOCH)
              for r in range(4)]
    per = case.BATCH_PER_RANK
    batches = [sum((share[k * per:(k + 1) * per] for share in shares), []) for k in range(case.STEPS)]
    reference, initial = case._single_process_reference(batches), case._single_process_reference([])
    for name, value in reference.items():
        assert not torch.allclose(value, initial[name], atol=1e-4), f"{name} did not train"
        for rank, params in enumerate(ranks):
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


@pytest.mark.slow
def test_digits_on_two_hosts_reaches_095(cluster, client):
    digits = REPO / "examples" / "digits"
    spec = JobSpec.from_yaml_text((digits / "job.yaml").read_text())
    fields = {k: v for k, v in spec.model_dump(mode="json", exclude_defaults=True, by_alias=True).items()
              if k != "workers"}
    spec = JobSpec.parse({**fields, "nodes": 2, "workers_per_node": 1})
    job = client.submit(spec, base_dir=digits)
    final = client.wait(job.id, timeout=240)
    assert final.state == JobState.SUCCEEDED, describe(client, job.id)
    assert len({p.node_name for p in final.placement}) == 2, final.placement
    text = "\n".join(line.text for line in client.iter_logs(job.id))
    accuracy = float(re.search(r"^test_accuracy=([0-9.]+)$", text, re.M).group(1))
    assert accuracy >= 0.95, text[-2000:]


@pytest.mark.slow
def test_a_cut_link_loses_the_node_the_job_moves_and_the_stale_workers_are_fenced(cluster, client, reference_model,
                                                                                    tmp_path):
    """``ip link set … down`` on a host mid-job: its node is LOST within the heartbeat timeout, the
    job restarts on the other hosts from its checkpoint without counting it, and finishes with the
    model of an uninterrupted run; when the link comes back, the stale workers are stopped and
    commit nothing (the final model would differ if they did), and the node is READY again."""
    import test_fault_tolerance as ft

    job = client.submit(ft.trainer_spec("cut", "--sleep 0.4", nodes=2, workers_per_node=1), base_dir=ft.JOBS)
    ft.wait_for_step(client, job.id, 1, 12)
    placed = {p.node_name for p in client.job(job.id).placement}
    victim = next(h for h in cluster.agent_hosts if h.name in placed and h.name != sorted(placed)[0])
    stale = chaos.job_pids(job.id, attempt=1)
    cluster.hosts.cut(victim)
    try:
        chaos.wait_until(lambda: {n.name: n.state for n in client.nodes()}[victim.name] == "LOST", 30,
                         f"{victim.name} to be LOST")
        moved = chaos.wait_until(lambda: (lambda j: j if j.attempt >= 2 and j.placement else None)(client.job(job.id)),
                                 60, "attempt 2 to be placed")
        assert victim.name not in {p.node_name for p in moved.placement}
        ft.wait_for_step(client, job.id, 2, 1 + ft.INTERVAL * 3)
        assert set(stale) & set(chaos.job_pids(job.id, attempt=1)), "the cut host's workers run on, unaware"
    finally:
        cluster.hosts.restore(victim)
    chaos.wait_until(lambda: not chaos.job_pids(job.id, attempt=1), 60, "the stale workers to be stopped")
    chaos.wait_until(lambda: {n.name: n.state for n in client.nodes()}[victim.name] == "READY", 60,
                     f"{victim.name} to be READY again")
    final = client.wait(job.id, timeout=180)
    assert final.state == JobState.SUCCEEDED, describe(client, job.id)
    assert final.restarts == 0 and "lost" in final.restart_reasons[0].reason, final.restart_reasons
    ft.assert_resumes(ft.metric_points(client, job.id), attempts=final.attempt, unreported_steps=True)
    ft.assert_same_model(client, job.id, tmp_path / "out", reference_model)


def test_the_server_killed_and_started_again_on_its_host_loses_nothing_of_a_two_host_job(cluster, client):
    job = client.submit(JobSpec.parse({"name": "counted", "entrypoint": "python counter.py 120", "nodes": 2,
                                       "workers_per_node": 1}), base_dir=JOBS / "plain")
    chaos.wait_until(lambda: len(list(client.iter_logs(job.id))) >= 10, 120, "ten log lines")
    placed = [h for h in cluster.agent_hosts if h.name in {p.node_name for p in client.job(job.id).placement}]
    failed_before = [cluster.agent_log(h).count("failed") for h in placed]
    cluster.kill_server()
    try:  # the job runs on while its agents find no server, and keep what it writes
        chaos.wait_until(lambda: all(cluster.agent_log(h).count("failed") > n for h, n in zip(placed, failed_before)),
                         60, "the agents to miss the server")
    finally:
        cluster.start_server()
    final = client.wait(job.id, timeout=180)
    assert final.state == JobState.SUCCEEDED, describe(client, job.id)
    for rank in (0, 1):  # (c10d warns, in a namespace, that it cannot name the peer: not the script's lines)
        lines = [line.text for line in client.iter_logs(job.id, rank=rank) if not line.text.startswith("[W")]
        assert lines == [f"line {i}" for i in range(120)]
    steps = sorted(p.step for p in client.iter_metrics(job.id))
    assert steps == sorted(list(range(120)) * 2)


@pytest.mark.slow
def test_a_parameter_server_job_with_its_servers_on_a_third_host(cluster, client):
    digits = REPO / "examples" / "digits"
    # each agent offers 2 cpus: a worker (1 cpu) per host on two hosts leaves 1 on each, so the
    # server (2 cpus) can only go to the third
    spec = {"name": "digits-ps", "workdir": ".", "entrypoint": "python train.py --epochs 3 --batch-size 32",
            "nodes": 2, "workers_per_node": 1, "resources": {"cpu": 1, "memory": "1GiB"},
            "strategy": {"kind": "parameter_server", "servers": 1, "mode": "sync",
                         "optimizer": {"name": "adam", "lr": 0.003}, "server_resources": {"cpu": 2, "memory": "1GiB"}}}
    job = client.submit(spec, base_dir=digits)
    final = client.wait(job.id, timeout=240)
    logs = "\n".join(line.text for line in client.iter_logs(job.id))
    assert final.state == JobState.SUCCEEDED, (describe(client, job.id), logs[-3000:])
    assert len({p.node_name for p in final.placement}) == 3, final.placement
    assert float(re.search(r"test_accuracy=([0-9.]+)", logs).group(1)) >= 0.9, logs[-2000:]


@pytest.mark.slow
def test_a_two_stage_pipeline_with_one_stage_per_host(cluster, client, tmp_path):
    import inspect
    import json

    charlm = REPO / "examples" / "charlm"
    work = tmp_path / "charlm"
    work.mkdir()
    for name in ("data.py", "model.py", "train_pipeline.py"):
        (work / name).write_text((charlm / name).read_text())
    (work / "corpus.txt").write_text(inspect.getsource(json) * 3)  # a text that ships with Python
    spec = JobSpec.parse({"name": "pipe", "nodes": 2, "workers_per_node": 1,
                          "entrypoint": "python train_pipeline.py --data corpus.txt --steps 20 --layers 2",
                          "strategy": {"kind": "pipeline", "microbatches": 4}})
    job = client.submit(spec, base_dir=work)
    final = client.wait(job.id, timeout=240)
    logs = "\n".join(line.text for line in client.iter_logs(job.id))
    assert final.state == JobState.SUCCEEDED, (describe(client, job.id), logs[-3000:])
    assert len({p.node_name for p in final.placement}) == 2, final.placement
    assert "final loss=" in logs
