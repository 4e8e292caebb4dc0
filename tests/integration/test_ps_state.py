"""Checkpoints of server state: ``state_dict`` gathers parameters and optimizer buffers from
every shard; ``load_state_dict`` into fresh servers continues exactly where training was.
Real shard servers on 127.0.0.1 (threads of this process) and a real worker client."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from torchrelay.spec import ServerOptimizer
from torchrelay.train.ps.client import PSOptimizer
from torchrelay.train.ps.plan import Plan
from torchrelay.train.ps.rendezvous import ShardDirectory
from torchrelay.train.ps.server import ShardServer, ShardState, buffers_for

pytestmark = pytest.mark.timeout(60)
OPT = ServerOptimizer(name="adam", lr=0.01)
SERVERS = 2


class Cluster:
    """A store, and shard servers started as soon as a worker publishes the plan."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.directory = ShardDirectory(self.store, prefix="t")
        self.servers: list[ShardServer] = []
        self.threads: list[threading.Thread] = []
        self.starter = threading.Thread(target=self._start, daemon=True)
        self.starter.start()

    def _start(self) -> None:
        plan = Plan.from_json(self.directory.read_plan())
        for i in range(SERVERS):
            shard = plan.shard(i)
            server = ShardServer(shard, ShardState.allocate(shard, buffers_for(OPT), 1), num_workers=1,
                                 mode="sync", staleness=0, optimizer=OPT)
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            self.servers.append(server)
            self.threads.append(thread)
            self.directory.publish(i, f"{server.host}:{server.port}", 0)

    def worker(self, model: torch.nn.Module) -> PSOptimizer:
        return PSOptimizer(model, rank=0, num_workers=1, servers=SERVERS, mode="sync", optimizer_config=OPT,
                           directory=self.directory, reconnect_timeout_s=10)

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        for thread in self.threads:
            thread.join(timeout=5)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def train(net: torch.nn.Module, opt: PSOptimizer, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_state_dict_round_trip_continues_training_exactly(transport, monkeypatch):
    """Over shared memory (the default on one host) and over TCP (RELAY_PS_SHM=0)."""
    if transport == "tcp":
        monkeypatch.setenv("RELAY_PS_SHM", "0")
    first = Cluster()
    try:
        net = model()
        opt = first.worker(net)
        assert [link.shm for link in opt.links] == [transport == "shm"] * SERVERS
        train(net, opt, range(5))
        state = opt.state_dict()
        train(net, opt, range(5, 10))
        expected = {k: v.clone() for k, v in net.state_dict().items()}
        opt.close()
    finally:
        first.close()
    assert state["version"] == 5 and state["clocks"] == [5]
    assert set(state["buffers"]) == {"exp_avg", "exp_avg_sq"}
    assert state["buffers"]["exp_avg"]["0.weight"].shape == (16, 8)
    assert all(v == 5.0 for v in state["steps"].values())
    assert any(v.abs().sum() > 0 for v in state["buffers"]["exp_avg_sq"].values())

    second = Cluster()
    try:
        net2 = model()
        torch.nn.init.zeros_(net2[0].weight)  # what the servers start with must not matter
        opt2 = second.worker(net2)
        opt2.load_state_dict(state)
        torch.testing.assert_close(net2[0].weight.detach(), state["params"]["0.weight"])
        opt2.load_state_dict(state)  # a second worker restoring the same checkpoint: no-op
        train(net2, opt2, range(5, 10))
        for name, value in net2.state_dict().items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
        opt2.close()
    finally:
        second.close()


def test_load_state_dict_refuses_a_state_for_another_model():
    cluster = Cluster()
    try:
        net = model()
        opt = cluster.worker(net)
        state = opt.state_dict()
        bad = {**state, "params": {**state["params"], "0.weight": torch.zeros(3, 3)}}
        with pytest.raises(ValueError, match="'0.weight' is \\(3, 3\\)"):
            opt.load_state_dict(bad)
        with pytest.raises(ValueError, match="format"):
            opt.load_state_dict({"params": {}})
        opt.close()
    finally:
        cluster.close()
