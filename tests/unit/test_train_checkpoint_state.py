"""torchrelay.train.TrainState: a resumed run continues the uninterrupted one exactly (one process).

The two-rank version (real torchrun, gloo, DDP) is tests/integration/test_checkpoint.py.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import torchrelay.train as rt
from torchrelay.errors import StorageError
from torchrelay.train.checkpoint_state import capture_rng, restore_rng

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

EPOCHS, SAMPLES, BATCH = 3, 40, 4  # 10 steps per epoch


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "RELAY_JOB_ID", "RELAY_STORE_URL", "RELAY_JOB_STORE_PREFIX", "RELAY_STRATEGY",
                 "RELAY_CHECKPOINT", "RELAY_METRICS_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELAY_OUTPUT_DIR", str(tmp_path / "out"))
    rt.shutdown()
    yield
    rt.wait_for_checkpoint()
    rt.shutdown()


class _Noisy(torch.utils.data.Dataset):
    """Augments with torch's RNG in __getitem__, as image pipelines do."""

    def __init__(self):
        self.x = torch.linspace(-1, 1, SAMPLES * 3).reshape(SAMPLES, 3)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return index, self.x[index] + 0.01 * torch.randn(3)


def run(*, stop_at: int | None = None, resume: bool = False, async_: bool = False,
        process_seed: int = 0, workers: int = 0) -> tuple[list[tuple], dict]:
    """Train; save at ``stop_at`` and stop there, as a killed job would."""
    torch.manual_seed(process_seed)  # a restarted process starts from other RNG states
    random.seed(process_seed)
    np.random.seed(process_seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            param.copy_(torch.linspace(-0.3, 0.3, param.numel()).reshape(param.shape))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = rt.shard(_Noisy(), batch_size=BATCH, seed=7, num_workers=workers)
    state = rt.TrainState(model, optimizer, loader)
    assert state.restore() == resume
    records = []
    for epoch in state.epochs(EPOCHS):
        for indices, x in state.batches():
            optimizer.zero_grad()
            loss = model(x).pow(2).mean() + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            loss.backward()
            optimizer.step()
            assert torch.isfinite(loss)
            records.append((state.step, epoch, indices.tolist(), round(loss.item(), 10)))
            if state.step == stop_at:
                state.save(async_=async_)
                return records, {k: v.clone() for k, v in model.state_dict().items()}
    return records, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stop_at, async_, workers", [(13, False, 0), (10, False, 0), (17, True, 0), (13, False, 1)],
                         ids=["mid-epoch", "epoch-end", "mid-epoch-async", "mid-epoch-loader-process"])
def test_a_resumed_run_continues_the_uninterrupted_one_exactly(stop_at, async_, workers):
    # with a loader process the augmentation draws come from a seed the loader drew at the epoch's start
    full, final = run(workers=workers)
    assert [r[0] for r in full] == list(range(1, EPOCHS * SAMPLES // BATCH + 1))
    first, _ = run(stop_at=stop_at, async_=async_, workers=workers)
    assert first == full[:stop_at]
    rt.wait_for_checkpoint()
    resumed, resumed_final = run(resume=True, process_seed=1234, workers=workers)
    assert resumed == full[stop_at:]  # same batches, same order, same dropout and augmentation draws
    for key, value in final.items():
        assert torch.equal(resumed_final[key], value), key


def test_restore_without_a_checkpoint_changes_nothing():
    model = torch.nn.Linear(2, 1)
    state = rt.TrainState(model)
    before = model.weight.clone()
    assert state.restore() is False
    assert (state.step, state.epoch, state.position) == (0, 0, 0) and torch.equal(model.weight, before)


def test_rng_states_round_trip():
    saved = capture_rng()
    expected = (torch.rand(3), random.random(), np.random.rand(2))
    torch.rand(5), random.random(), np.random.rand(4)
    restore_rng(saved)
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(again[0], expected[0]) and again[1] == expected[1] and np.array_equal(again[2], expected[2])


def test_batches_needs_the_loader():
    state = rt.TrainState(torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match="needs the loader"):
        next(state.batches())


def test_a_save_the_store_fails_is_reported_and_training_goes_on(tmp_path, monkeypatch):
    """A real failure (the checkpoints folder is a file, so nothing can be written below it):
    ``save`` returns None, counts and reports it; the next save, once the store is sound, commits."""
    monkeypatch.setenv("RELAY_METRICS_DIR", str(tmp_path / "metrics"))
    rt.init()
    model = torch.nn.Linear(2, 1)
    state = rt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    blocker = tmp_path / "out" / "jobs" / "local" / "checkpoints"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a folder")
    state.step = 3
    assert state.save(async_=False) is None
    assert state.save_failures == 1
    with pytest.raises(StorageError, match="step 3"):
        state.save(async_=False, on_error="raise")
    blocker.unlink()
    state.step = 4
    assert state.save(async_=False).endswith("/step-0000000004")
    rt.flush_metrics()
    (line,) = (tmp_path / "metrics" / "rank-0.jsonl").read_text().splitlines()
    assert json.loads(line)["values"] == {"checkpoint_failures": 1, "checkpoint_failed_step": 3}
