"""CPU and GPU workers in one job (``resources: {accelerator: any}``), through the platform.

CPU half (runs here): two agents under their cgroups, one offering ``--cpus 1`` and declaring a
GPU it does not have (``--gpus 1 --gpu-type fake``), one offering ``--cpus 0.5`` and no GPU. A
two-rank balanced DDP job of accelerator "any" is placed over both: the rank on the GPU node is
a GPU rank (RELAY_ACCELERATOR=gpu, one device index), the other a CPU rank; every rank is told
RELAY_MIXED_DEVICES=1 and builds gloo; each trains on its own device (here both are CPUs: no
CUDA, so the script's CUDA work is skipped) and every re-split of the shares is the split in
proportion to the speeds measured then. Whether the 1-cpu rank really is faster depends on the
machine's load (its quota is a ceiling), so that is not asserted.

GPU half (skipped without CUDA): the same job with a real GPU on the GPU agent; its rank trains
on ``cuda:0`` in the gloo group beside a CPU rank.
"""
from __future__ import annotations

import json

import pytest

from torchrelay.agent import cgroups
from torchrelay.client.cluster import AgentOptions
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobSpec, JobState
from torchrelay.train.shares import proportional_shares

pytestmark = pytest.mark.timeout(240)

GLOBAL_BATCH = 64

TRAIN = '''
import json, os
import torch, torch.nn.functional as F
import torchrelay.train as rt
from torchrelay.train.session import current_session

ctx = rt.init()
torch.manual_seed(0)
x = torch.randn(4096, 32)
y = (x.sum(1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 2)).to(ctx.device)
model, optimizer = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
loader = rt.shard(torch.utils.data.TensorDataset(x, y), batch_size=%(per_rank)d, seed=0)
import torch.distributed as dist
print("DEVICE " + json.dumps({
    "rank": ctx.rank, "device": str(ctx.device), "backend": dist.get_backend(),
    "cuda": torch.cuda.is_available(), "first_share": current_session().balancer.share,
    "env": {k: os.environ.get(k) for k in ("RELAY_ACCELERATOR", "RELAY_GPUS_PER_WORKER", "RELAY_MIXED_DEVICES",
                                           "CUDA_VISIBLE_DEVICES", "RELAY_GPU_TYPE")}}), flush=True)
resplits, step, seen = [], 0, 0
while step < %(steps)d:
    loader.sampler.set_epoch(step)
    for xs, ys in loader:
        xs, ys = xs.to(ctx.device), ys.to(ctx.device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xs), ys)
        loss.backward()
        optimizer.step()
        step += 1
        rt.report(step, loss=loss.item(), batch=len(ys))
        balancer = current_session().balancer
        if balancer.resplits > seen:
            seen = balancer.resplits
            resplits.append({"step": step, "shares": list(balancer.shares), "speeds": list(balancer.speeds)})
        if step >= %(steps)d:
            break
balancer = current_session().balancer
print("RESULT " + json.dumps({"rank": ctx.rank, "shares": list(balancer.shares), "speeds": list(balancer.speeds or ()),
                              "resplits": resplits, "loss": loss.item()}), flush=True)
rt.shutdown()
'''


def _run_mixed_job(cluster, tmp_path, steps: int = 40) -> tuple[object, dict, dict]:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text(TRAIN % {"per_rank": GLOBAL_BATCH // 2, "steps": steps})
    spec = JobSpec.parse({
        "name": "mixed", "entrypoint": "python train.py", "nodes": 2, "workers_per_node": 1,
        "resources": {"cpu": 0.5, "accelerator": "any"},
        "strategy": {"kind": "ddp", "balance": "throughput", "balance_every": 10, "balance_threshold": 0.05}})
    with RelayClient(cluster.address) as client:
        info = client.submit(spec, base_dir=tmp_path / "job")
        final = client.wait(info.id, timeout=180, poll_s=0.5)
        assert final.state == JobState.SUCCEEDED, final.failure
        lines = {}
        for rank in (0, 1):
            for line in client.iter_logs(info.id, rank=rank):
                for tag in ("DEVICE", "RESULT"):
                    if line.text.startswith(tag + " "):
                        lines[(tag, rank)] = json.loads(line.text.split(" ", 1)[1])
    devices = {lines[("DEVICE", r)]["env"]["RELAY_ACCELERATOR"]: lines[("DEVICE", r)] for r in (0, 1)}
    results = {r: lines[("RESULT", r)] for r in (0, 1)}
    return final, devices, results


def _check_balanced(results: dict) -> None:
    # the ranks agree on the shares, which always add up to the global batch
    assert results[0]["shares"] == results[1]["shares"] and sum(results[0]["shares"]) == GLOBAL_BATCH
    assert all(s > 0 for s in results[0]["speeds"]), results  # every rank's speed was measured
    for resplit in results[0]["resplits"]:  # each re-split: the shares follow the speeds measured then
        # a whole move is the split of that window's speeds; a fine move (shares.fine_resplit) is
        # the split of the steady speeds of several windows, which need not be the last window's
        # split: it still gives the faster rank the larger share
        faster = max((0, 1), key=lambda r: resplit["speeds"][r])
        assert resplit["shares"] == list(proportional_shares(resplit["speeds"], GLOBAL_BATCH)) \
            or resplit["shares"][faster] > resplit["shares"][1 - faster], resplit


def test_a_job_of_any_device_runs_gpu_and_cpu_ranks_in_one_gloo_group(cluster_factory, tmp_path):
    cluster = cluster_factory(2, agent_options=[AgentOptions(cpus=1, gpus=1, gpu_type="fake"),
                                                AgentOptions(cpus=0.5)])
    final, devices, results = _run_mixed_job(cluster, tmp_path)
    assert set(devices) == {"gpu", "cpu"}, devices  # one GPU rank, one CPU rank
    gpu, cpu = devices["gpu"], devices["cpu"]
    assert gpu["env"] == {"RELAY_ACCELERATOR": "gpu", "RELAY_GPUS_PER_WORKER": "1", "RELAY_MIXED_DEVICES": "1",
                          "CUDA_VISIBLE_DEVICES": "0", "RELAY_GPU_TYPE": "fake"}
    assert cpu["env"].pop("CUDA_VISIBLE_DEVICES") in (None, "")  # a node without GPUs: set or not, none named
    assert cpu["env"] == {"RELAY_ACCELERATOR": "cpu", "RELAY_GPUS_PER_WORKER": "0", "RELAY_MIXED_DEVICES": "1",
                          "RELAY_GPU_TYPE": None}
    assert gpu["backend"] == cpu["backend"] == "gloo"
    assert cpu["device"] == "cpu"
    # the declared GPU does not exist here: its rank's CUDA work is skipped and it trains on the CPU
    assert gpu["device"] == ("cuda:0" if gpu["cuda"] else "cpu")
    # the first split, before any step was measured: in proportion to the two CPU ranks' quotas
    # (1 and 0.5 cpu, enforced where cgroups are usable); without them each may use one CPU (its one thread): even
    if not gpu["cuda"]:
        expected = (43, 21) if cgroups.cgroups_usable()[0] else (32, 32)
        assert (gpu["first_share"], cpu["first_share"]) == expected, (gpu, cpu)
    assert any("CPU ranks on" in (e.message or "") for e in final.events), [e.message for e in final.events]
    _check_balanced(results)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() == 0, reason="needs a CUDA device (the accelerator machine)")
def test_a_real_gpu_rank_trains_on_cuda_beside_a_cpu_rank(cluster_factory, tmp_path):
    cluster = cluster_factory(2, agent_options=[AgentOptions(cpus=2, gpus=1, gpu_type="cuda"),
                                                AgentOptions(cpus=2)])
    _, devices, results = _run_mixed_job(cluster, tmp_path, steps=80)
    assert devices["gpu"]["device"] == "cuda:0" and devices["gpu"]["cuda"]
    assert devices["cpu"]["device"] == "cpu"
    assert devices["gpu"]["backend"] == devices["cpu"]["backend"] == "gloo"
    # a GPU rank's speed is unknown before it is measured: the first split is even
    assert devices["gpu"]["first_share"] == devices["cpu"]["first_share"] == GLOBAL_BATCH // 2
    _check_balanced(results)

