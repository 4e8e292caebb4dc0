"""Checkpoints on two real gloo ranks under torchrun: sharded DCP writes, and a killed run that
resumes from its checkpoint continues the uninterrupted run exactly (data order, RNG, model).

This file is also the worker script torchrun starts (``python test_checkpoint.py OUT MODE``).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

HERE = Path(__file__).resolve().parent
STEPS_PER_EPOCH, EPOCHS, EVERY, KILL_AT = 8, 2, 5, 12  # resumes from step 10, mid epoch 2


def run_torchrun(*args, **kwargs):
    """The tests' owned torchrun (tests/torchrun_helper.py)."""
    from torchrun_helper import run_torchrun as run

    return run(*args, **kwargs)


# ---------------------------------------------------------------- the worker (run by torchrun)


def worker(out_dir: str, modes: str) -> None:
    """Train once per mode, in order ('killed' dies at KILL_AT). Each mode is its own job id."""
    import torchrelay.train as rt

    ctx = rt.init()
    for mode in modes.split(","):
        os.environ["RELAY_JOB_ID"] = f"j-{mode}" if mode == "full" else "j-ckpt"
        os.environ["RELAY_JOB_STORE_PREFIX"] = f"jobs/{os.environ['RELAY_JOB_ID']}"
        train(ctx, out_dir, mode)
    rt.shutdown()
    sys.stdout.flush()
    os._exit(0)  # the exit status says whether the work ran, not whether teardown was lucky (docs/design.md, exit-time abort)


def train(ctx, out_dir: str, mode: str) -> None:  # noqa: ANN001
    import random

    import numpy as np
    import torch

    import torchrelay.train as rt

    seed = 0 if mode != "resume" else 1000 + ctx.rank  # a restarted process starts from other RNG states
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(STEPS_PER_EPOCH * 4 * ctx.world_size, 6, generator=generator)
    targets = features.sum(dim=1, keepdim=True)
    dataset = torch.utils.data.TensorDataset(torch.arange(len(features)), features, targets)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.linspace(-0.4, 0.4, param.numel()).reshape(param.shape))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = rt.prepare(model, optimizer)
    loader = rt.shard(dataset, batch_size=4, seed=3)
    state = rt.TrainState(model, optimizer, loader)
    resumed = state.restore()
    records = []
    for epoch in state.epochs(EPOCHS):
        for indices, x, y in state.batches():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y) + random.random() * 1e-4
            loss.backward()
            optimizer.step()
            records.append([state.step, epoch, indices.tolist(), loss.item()])
            if rt.checkpoint_due(state.step):
                state.save()
            if mode == "killed" and state.step == KILL_AT:
                rt.wait_for_checkpoint()
                # dies here, as a killed worker would: no shutdown, nothing flushed
                Path(out_dir, f"records-{mode}-{ctx.rank}.json").write_text(json.dumps(records))
                sys.stdout.flush()
                os._exit(0)
    rt.wait_for_checkpoint()
    Path(out_dir, f"records-{mode}-{ctx.rank}.json").write_text(json.dumps({"resumed": resumed, "records": records}))
    torch.save(rt.unwrap(model).state_dict(), Path(out_dir, f"model-{mode}-{ctx.rank}.pt"))


# ---------------------------------------------------------------- the test


def _launch(tmp_path: Path, modes: str, store: str, policy: dict) -> None:
    env = {"RELAY_STORE_URL": store, "RELAY_CHECKPOINT": json.dumps(policy),
           "RELAY_STRATEGY": json.dumps({"kind": "ddp"})}
    result = run_torchrun([str(Path(__file__).resolve()), str(tmp_path), modes], nproc=2, cwd=HERE, env=env)
    assert result.returncode == 0, result.stdout[-4000:]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_killed_two_rank_job_resumes_exactly_where_its_checkpoint_left_off(tmp_path, async_):
    import torch

    from torchrelay.storage import ArtifactStore
    from torchrelay.train.checkpoint import CheckpointStore

    store = f"file://{tmp_path / 'store'}"
    policy = {"every_steps": EVERY, "keep": 2, "async": async_}
    _launch(tmp_path, "killed", store, policy)

    checkpoints = CheckpointStore(ArtifactStore(store), "j-ckpt", keep=2)
    assert checkpoints.latest_name() == "step-0000000010"
    folder = tmp_path / "store" / "jobs" / "j-ckpt" / "checkpoints" / "step-0000000010"
    shards = sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp")
    # DDP replicas: DCP spreads the replicated tensors over both ranks, each writes its share
    assert any(s.startswith("__0_") for s in shards) and any(s.startswith("__1_") for s in shards), shards
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert set(shards) <= set(manifest["files"])

    _launch(tmp_path, "resume,full", store, policy)  # then the uninterrupted run, in the same processes
    for rank in range(2):
        full = json.loads((tmp_path / f"records-full-{rank}.json").read_text())
        killed = json.loads((tmp_path / f"records-killed-{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"records-resume-{rank}.json").read_text())
        assert not full["resumed"] and resumed["resumed"]
        assert killed == full["records"][:KILL_AT]
        assert [r[0] for r in resumed["records"]] == list(range(11, STEPS_PER_EPOCH * EPOCHS + 1))
        assert resumed["records"] == full["records"][10:]  # same batches, same order, same losses
        full_model = torch.load(tmp_path / f"model-full-{rank}.pt", weights_only=True)
        resumed_model = torch.load(tmp_path / f"model-resume-{rank}.pt", weights_only=True)
        for key, value in full_model.items():
            assert torch.equal(resumed_model[key], value), key


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
