"""A parameter_server job through the whole platform: the server places the servers as their own
role (own resources, own launch), the agent starts workers and servers, and the unchanged digits
example trains to accuracy."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from torchrelay.client.cluster import AgentOptions
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobState

pytestmark = pytest.mark.timeout(300)

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"


def test_digits_under_a_parameter_server_job_places_servers_as_their_own_launch(cluster_factory):
    cluster = cluster_factory(1, agent_options=[AgentOptions(cpus=4, memory="8GiB")])
    spec = {"name": "digits-ps", "workdir": ".", "entrypoint": "python train.py --epochs 3 --batch-size 32",
            "workers": 2, "resources": {"cpu": 1, "memory": "1GiB"},
            "strategy": {"kind": "parameter_server", "servers": 1, "mode": "sync",
                         "optimizer": {"name": "adam", "lr": 0.003},
                         "server_resources": {"cpu": 2, "memory": "1GiB"}}}
    with RelayClient(cluster.address) as client:
        job = client.submit(spec, base_dir=DIGITS)
        info = client.wait(job.id, timeout=240, poll_s=0.5)
        logs = "\n".join(line.text for line in client.iter_logs(job.id))
        node = client.nodes()[0]
        memory = {p.rank: p.values for p in client.metrics(job.id).points if "memory_parameters" in p.values}
    assert info.state == JobState.SUCCEEDED, (info.failure, logs[-3000:])
    placed = next(e.message for e in info.events if e.state == JobState.SCHEDULED)
    assert "servers on" in placed, placed
    # two launches on the one node: the workers' (2 × 1 cpu) and the server's (1 × 2 cpus)
    assert sorted(p.workers for p in info.placement) == [1, 2], info.placement
    accuracy = float(re.search(r"test_accuracy=([0-9.]+)", logs).group(1))
    assert accuracy >= 0.9, logs[-2000:]
    assert node.used_cpus == 0  # everything it held was given back
    # memory per rank: each worker the whole model and its gradients, no optimizer state; the server (rank 2)
    # its shard, all of the model here, and Adam's two moments of it
    assert sorted(memory) == [0, 1, 2], memory
    for worker in (0, 1):
        assert memory[worker]["memory_gradients"] == memory[worker]["memory_parameters"] > 0, memory
        assert memory[worker]["memory_optimizer_state"] == 0
    assert memory[2]["memory_parameters"] >= memory[0]["memory_parameters"]  # the flat buffer, aligned
    assert memory[2]["memory_optimizer_state"] >= 2 * memory[2]["memory_parameters"]
