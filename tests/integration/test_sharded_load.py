"""A sharded load on real gloo ranks: each fsdp rank reads only its own shards of a checkpoint, measured as the
peak resident memory the load adds; a ddp job's checkpoint loads into an fsdp job and training goes on alike.

This file is also the worker script (``python test_sharded_load.py SCENARIO RANK WORLD PORT OUT_DIR``, run by
``tests/rank_scripts.run_ranks``); each rank writes ``OUT_DIR/SCENARIO-RANK.json``.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from test_sharded import _train  # the same steps; this folder is on sys.path as a script and under pytest

pytestmark = pytest.mark.timeout(300)

WIDTH, LAYERS, BATCH, LR = 1024, 4, 8, 1e-3
# parameters and Adam's two moments, whole: what a load that rebuilds whole tensors reads on every rank
STATE_BYTES = 3 * LAYERS * WIDTH * WIDTH * 4


def mlp(seed: int) -> nn.Module:
    """4 MiB per weight: each rank's shard (2 MiB) is above the 1 MiB from which freed memory goes back to the
    kernel under fsdp (train.allocator), so resident memory follows what a load holds."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def train(model, opt, first: int, last: int, rank: int, world: int) -> list[float]:  # noqa: ANN001
    return _train(model, opt, first, last, rank, world, batch)


def _kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def peak_growth(fn):
    """(fn(), bytes by which this process's peak resident memory rose above its resident memory before)."""
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    out = fn()
    return out, (_kib("VmHWM") - before) * 1024


def worker(scenario: str, rank: int, world: int, port: int, out_dir: str) -> None:
    import torchrelay.train as rt
    from torchrelay.spec import DDPStrategy, FSDPStrategy
    from torchrelay.train.checkpoint import load_checkpoint
    from torchrelay.train.checkpoint_shards import shard_target

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RELAY_STRATEGY=json.dumps({"kind": "fsdp"}),
                      RELAY_OUTPUT_DIR=str(Path(out_dir) / "store"))
    from torchrelay.train.allocator import return_large_allocations

    # what fsdp's prepare sets, from the start: the ddp phase's freed tensors must not stay in the heap for the
    # loads below to reuse (resident memory would then not show what a load allocates)
    return_large_allocations()
    ctx = rt.init()
    out: dict = {}

    # a ddp job saves at step 1 and trains on
    ctx.strategy = DDPStrategy()
    model = mlp(0)
    model, opt = rt.prepare(model, torch.optim.Adam(model.parameters(), lr=LR))
    state = rt.TrainState(model, opt)
    out["ddp"] = train(model, opt, 1, 1, rank, world)
    state.step = 1
    state.save(async_=False)
    out["ddp"] += train(model, opt, 2, 3, rank, world)

    # an fsdp job resumes it (model sharded on load, Adam's state by index), trains the same, saves at step 3
    ctx.strategy = FSDPStrategy(kind="fsdp")
    model = mlp(1)  # another start: only the checkpoint can make it equal
    model, opt = rt.prepare(model, torch.optim.Adam(model.parameters(), lr=LR))
    state = rt.TrainState(model, opt)
    assert state.restore()
    out["from_ddp"] = {"resumed_at": state.step, "losses": train(model, opt, 2, 3, rank, world)}
    state.step = 3
    state.save(async_=False)
    saved = rt.full_state_dict(model)

    # a fresh fsdp model: the whole load against the sharded one, then restore through TrainState
    model = mlp(2)
    model, opt = rt.prepare(model, torch.optim.Adam(model.parameters(), lr=LR))
    whole, out["whole_growth"] = peak_growth(load_checkpoint)
    del whole
    loaded, out["sharded_growth"] = peak_growth(lambda: load_checkpoint(target=lambda: shard_target(model, opt)))
    (sharded, step), inner_state = loaded, loaded[0]["optimizer"]["inner"]["state"]
    out["loaded_step"] = step
    out["model_values"] = {k: [type(v).__name__, list(getattr(v, "_local_tensor", v).shape)]
                           for k, v in sharded["model"].items()}
    out["optimizer_values"] = sorted({type(v).__name__ for s in inner_state.values() for k, v in s.items()
                                      if k != "step"})
    del loaded, sharded, inner_state
    state = rt.TrainState(model, opt)
    assert state.restore()
    restored = rt.full_state_dict(model)
    if rank == 0:
        out["restored_diff"] = max((restored[k] - v).abs().max().item() for k, v in saved.items())
    out["after_restore"] = train(model, opt, 4, 4, rank, world)
    rt.shutdown()
    Path(out_dir, f"{scenario}-{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> list[dict]:
    from rank_scripts import run_ranks

    return run_ranks(__file__, tmp_path_factory.mktemp("sharded-load"), 2, "load", timeout=240)


def test_each_rank_reads_only_its_shards(launched: list[dict]) -> None:
    """The figure that could fail: a load that rebuilt whole tensors adds at least the whole state to a rank's peak
    resident memory (measured alongside: the load without a target does exactly that); the sharded load adds
    about half of it on 2 ranks (this rank's shards, one stored chunk's rows at a time)."""
    for r in launched:
        assert r["loaded_step"] == 3
        assert r["whole_growth"] >= STATE_BYTES, r  # the measure sees a whole load
        assert r["sharded_growth"] < 0.7 * STATE_BYTES, r
        # every weight came back as a DTensor holding this rank's half of the rows, Adam's moments likewise
        assert r["model_values"] == {f"module.{i}.weight": ["DTensor", [WIDTH // 2, WIDTH]] for i in range(LAYERS)}
        assert r["optimizer_values"] == ["DTensor"]
    assert launched[0]["restored_diff"] == 0.0


def test_a_ddp_checkpoint_resumes_under_fsdp_with_the_same_losses(launched: list[dict]) -> None:
    ddp, resumed = launched[0]["ddp"], launched[0]["from_ddp"]
    assert resumed["resumed_at"] == 1
    assert resumed["losses"] == pytest.approx(ddp[1:], rel=1e-5)  # parameters and Adam's moments both came back


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
