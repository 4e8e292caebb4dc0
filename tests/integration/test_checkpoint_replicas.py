"""Checkpoints of diverged replicas (local SGD, DiLoCo, final averaging) on two real gloo ranks under torchrun.

A job stopped after a checkpoint taken between sync points, then resumed in new processes
(other seeds, other initial weights), must end with the same parameters, buffers and optimizer
state on every rank as a run that never stopped: each rank's own model comes back, not rank 0's.
ddp keeps writing one copy. This file is also the worker script torchrun starts
(``python test_checkpoint_replicas.py OUT RUNS``, RUNS like ``killed:local_sgd,resume:diloco``).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

HERE = Path(__file__).resolve().parent
# H=4: syncs after steps 4, 8, 12; checkpoints at 6 (mid-period) and 12; stopped at 9, so the
# resume starts from step 6; the run ends at 14, mid-period, where the replicas still differ
STEPS_PER_EPOCH, EPOCHS, EVERY, KILL_AT, H = 7, 2, 6, 9, 4
STRATEGIES = {
    "ddp": {"kind": "ddp"},
    "local_sgd": {"kind": "local_sgd", "every": H},
    "diloco": {"kind": "diloco", "every": H, "outer_lr": 0.7, "outer_momentum": 0.9},
    "final_average": {"kind": "final_average"},  # parameters averaged at each checkpoint, Adam state not
}
ASYNC = {"ddp": False, "local_sgd": False, "diloco": True, "final_average": True}  # both save paths split alike


def run_torchrun(*args, **kwargs):
    """The tests' owned torchrun (tests/torchrun_helper.py)."""
    from torchrun_helper import run_torchrun as run

    return run(*args, **kwargs)


# ---------------------------------------------------------------- the worker (run by torchrun)


def job_id(mode: str, kind: str) -> str:
    return f"j-full-{kind}" if mode == "full" else f"j-ckpt-{kind}"


def worker(out_dir: str, runs: str) -> None:
    """Train once per ``mode:strategy`` in ``runs``, in order, each as its own job id."""
    import torchrelay.train as rt
    from torchrelay.train.environment import parse_strategy

    ctx = rt.init()
    modes = []
    for run in runs.split(","):
        mode, kind = run.split(":")
        modes.append(mode)
        ctx.strategy = parse_strategy(json.dumps(STRATEGIES[kind]))  # what RELAY_STRATEGY would say
        os.environ["RELAY_JOB_ID"] = job_id(mode, kind)
        os.environ["RELAY_JOB_STORE_PREFIX"] = f"jobs/{job_id(mode, kind)}"
        train(ctx, out_dir, mode, kind)
    if set(modes) != {"killed"}:
        rt.shutdown()
    sys.stdout.flush()
    os._exit(0)  # killed runs die here without shutdown; the status says the work ran (docs/design.md, exit-time abort)


def train(ctx, out_dir: str, mode: str, kind: str) -> None:  # noqa: ANN001
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
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    if mode != "resume":  # a resumed process starts from other weights: only the checkpoint can fix them
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.linspace(-0.4, 0.4, param.numel()).reshape(param.shape))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = rt.prepare(model, optimizer)
    loader = rt.shard(dataset, batch_size=4, seed=3)
    state = rt.TrainState(model, optimizer, loader)
    resumed = state.restore()
    records = []
    for _epoch in state.epochs(EPOCHS):
        for indices, x, y in state.batches():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            records.append([state.step, indices.tolist(), loss.item()])
            if rt.checkpoint_due(state.step):
                state.save(async_=ASYNC[kind])
            if mode == "killed" and state.step == KILL_AT:
                rt.wait_for_checkpoint()
                Path(out_dir, f"records-{mode}-{kind}-{ctx.rank}.json").write_text(json.dumps(records))
                return  # stops here, as a killed worker would: no finish, no shutdown
    rt.wait_for_checkpoint()
    Path(out_dir, f"records-{mode}-{kind}-{ctx.rank}.json").write_text(
        json.dumps({"resumed": resumed, "records": records}))
    final = {"model": rt.unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(final, Path(out_dir, f"final-{mode}-{kind}-{ctx.rank}.pt"))


# ---------------------------------------------------------------- the tests


def _launch(out: Path, runs: str, store: str) -> None:
    env = {"RELAY_STORE_URL": store, "RELAY_CHECKPOINT": json.dumps({"every_steps": EVERY, "keep": 3})}
    result = run_torchrun([str(Path(__file__).resolve()), str(out), runs], nproc=2, cwd=HERE, env=env)
    assert result.returncode == 0, result.stdout[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two launches: four jobs stopped at step 9; then three resumed, and the same three run straight through."""
    out = tmp_path_factory.mktemp("replicas")
    store = f"file://{out / 'store'}"
    kinds = ["local_sgd", "diloco", "final_average"]
    _launch(out, ",".join(f"killed:{kind}" for kind in ["ddp", *kinds]), store)
    _launch(out, ",".join([f"resume:{kind}" for kind in kinds] + [f"full:{kind}" for kind in kinds]), store)
    return out


def _metadata(out: Path, kind: str, step: int):
    from torchrelay.train.checkpoint import step_dirname
    from torchrelay.train.checkpoint_dcp import load_metadata

    folder = out / "store" / "jobs" / job_id("killed", kind) / "checkpoints" / step_dirname(step)
    return load_metadata((folder / ".metadata").read_bytes())


def _tensor_bytes(metadata, prefix: str) -> int:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for fqn, meta in metadata.state_dict_metadata.items():
        if fqn.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            total += meta.size.numel() * torch.empty((), dtype=meta.properties.dtype).element_size()
    return total


def _assert_same(a, b, where: str) -> None:
    import torch

    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{index}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where}: max |diff| {float((a.double() - b.double()).abs().max())}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("kind", ["local_sgd", "diloco", "final_average"])
def test_a_job_stopped_between_sync_points_resumes_each_replica_exactly(runs, kind):
    import torch

    finals = []
    for rank in range(2):
        full = json.loads((runs / f"records-full-{kind}-{rank}.json").read_text())
        killed = json.loads((runs / f"records-killed-{kind}-{rank}.json").read_text())
        resumed = json.loads((runs / f"records-resume-{kind}-{rank}.json").read_text())
        assert not full["resumed"] and resumed["resumed"]
        assert killed == full["records"][:KILL_AT]
        assert [r[0] for r in resumed["records"]] == list(range(EVERY + 1, STEPS_PER_EPOCH * EPOCHS + 1))
        assert resumed["records"] == full["records"][EVERY:], f"rank {rank}: batches or losses differ"
        straight = torch.load(runs / f"final-full-{kind}-{rank}.pt", weights_only=True)
        again = torch.load(runs / f"final-resume-{kind}-{rank}.pt", weights_only=True)
        _assert_same(straight, again, f"{kind} rank {rank}")  # bitwise: parameters, buffers, optimizer
        finals.append(straight)
    # the test could fail: the run ends mid-period, so the two replicas really differ
    assert not torch.equal(finals[0]["model"]["0.weight"], finals[1]["model"]["0.weight"])
    assert not torch.equal(finals[0]["optimizer"]["inner"]["state"][0]["exp_avg"],
                           finals[1]["optimizer"]["inner"]["state"][0]["exp_avg"])


@pytest.mark.parametrize("kind", ["local_sgd", "diloco"])
def test_each_rank_writes_its_own_replica_and_shared_state_once(runs, kind):
    from torchrelay.train.checkpoint_replicas import REPLICAS

    metadata = _metadata(runs, kind, EVERY)
    own = [_tensor_bytes(metadata, f"{REPLICAS}.rank-{rank}.") for rank in range(2)]
    assert own[0] == own[1] > 0, own
    # everything the ddp job writes of the model and its Adam state, once per rank here
    ddp = _metadata(runs, "ddp", EVERY)
    assert own[0] == _tensor_bytes(ddp, "model.") + _tensor_bytes(ddp, "optimizer.inner."), own
    assert _tensor_bytes(metadata, "model.") == 0 and _tensor_bytes(metadata, "optimizer.inner.") == 0
    if kind == "diloco":  # the global parameters and outer momentum: the same on both ranks, one copy
        assert _tensor_bytes(metadata, "optimizer.sync.rules.0.global_params") > 0


def test_final_average_writes_the_averaged_parameters_once_and_each_optimizer_state(runs):
    from torchrelay.train.checkpoint_replicas import REPLICAS

    metadata, ddp = _metadata(runs, "final_average", EVERY), _metadata(runs, "ddp", EVERY)
    own = [_tensor_bytes(metadata, f"{REPLICAS}.rank-{rank}.") for rank in range(2)]
    buffers = sum(_tensor_bytes(ddp, f"model.module.1.{name}") for name in ("running_mean", "running_var",
                                                                            "num_batches_tracked"))
    assert own[0] == own[1] == _tensor_bytes(ddp, "optimizer.inner.") + buffers, own
    assert _tensor_bytes(metadata, "model.") == _tensor_bytes(ddp, "model.") - buffers


def test_ddp_checkpoints_keep_one_copy(runs):
    from torchrelay.train.checkpoint_replicas import REPLICAS

    metadata = _metadata(runs, "ddp", EVERY)
    assert not any(fqn.startswith(REPLICAS) for fqn in metadata.state_dict_metadata)
    assert _tensor_bytes(metadata, "model.") > 0


def test_resuming_diverged_replicas_on_another_world_size_is_refused(runs, monkeypatch):
    from torchrelay.errors import InvalidSpec
    from torchrelay.train import load_checkpoint

    monkeypatch.setenv("RELAY_STORE_URL", f"file://{runs / 'store'}")
    monkeypatch.setenv("RELAY_JOB_ID", job_id("killed", "local_sgd"))
    for name in ("WORLD_SIZE", "RANK", "RELAY_JOB_STORE_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidSpec, match=r"diverged replicas of 2 ranks.*this job runs 1.*resume it with 2 workers"):
        load_checkpoint()  # one process, no process group: a world of 1


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
