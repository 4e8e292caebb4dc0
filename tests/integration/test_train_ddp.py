"""Two real gloo ranks under torchrun: DDP through torchrelay.train equals one process on the 2× batch.

This file is also the worker script: torchrun runs it with ``--worker OUT_DIR``.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
SEED, BATCH_PER_RANK, STEPS, EPOCH, LR, MOMENTUM = 3, 16, 12, 1, 0.05, 0.9


def _digits_module():
    spec = importlib.util.spec_from_file_location("digits_model", REPO / "examples" / "digits" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dataset() -> torch.utils.data.TensorDataset:
    """Random 8×8 images and labels (no sklearn import: the math, not the data, is under test);
    enough for 4 ranks (tests/integration/test_multihost.py runs this worker on 2 hosts × 2)."""
    generator = torch.Generator().manual_seed(11)
    images = torch.rand(STEPS * BATCH_PER_RANK * 4 + 40, 1, 8, 8, generator=generator)
    return torch.utils.data.TensorDataset(images, torch.randint(0, 10, (len(images),), generator=generator))


def run_torchrun(*args, **kwargs) -> subprocess.CompletedProcess:
    from torchrun_helper import run_torchrun as run

    return run(*args, **kwargs)


# ---------------------------------------------------------------- the worker (run by torchrun)


def worker(out_dir: str) -> None:
    import torch.nn.functional as F

    import torchrelay.train as rt

    ctx = rt.init()
    digits = _digits_module()
    torch.manual_seed(SEED)
    model = digits.DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model, optimizer = rt.prepare(model, optimizer)
    train_set = _dataset()
    loader = rt.shard(train_set, batch_size=BATCH_PER_RANK, seed=SEED)
    loader.sampler.set_epoch(EPOCH)
    for step, (images, labels) in zip(range(1, STEPS + 1), loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        rt.report(step, loss=loss.item())
    torch.save(rt.unwrap(model).state_dict(), os.path.join(out_dir, f"rank-{ctx.rank}.pt"))
    rt.shutdown()
    # Freeing the model after shutdown must not destroy the process group inside DDP's reducer
    # (which joins gloo's threads with the GIL held: a hang, see train/sync.py): its threads live on.
    threads = [len(os.listdir("/proc/self/task"))]
    del model, optimizer
    gc.collect()
    threads.append(len(os.listdir("/proc/self/task")))
    Path(out_dir, f"threads-{ctx.rank}.json").write_text(json.dumps(threads))
    if os.environ.get("RELAY_LAUNCH_ID"):
        return  # a job's worker: the platform's exit hook spares it the teardown abort, and needs the return
    # The exit status must say whether the math ran, not whether teardown was lucky (docs/design.md, exit-time abort).
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------- the test


def _single_process_reference(batches: list[list[int]]) -> dict[str, torch.Tensor]:
    import torch.nn.functional as F

    digits = _digits_module()
    torch.manual_seed(SEED)
    model = digits.DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    images, labels = _dataset().tensors
    for batch in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(images[batch]), labels[batch]).backward()
        optimizer.step()
    return model.state_dict()


def test_ddp_on_two_ranks_equals_one_process_on_the_double_batch(tmp_path):
    import torchrelay.train as rt

    result = run_torchrun([__file__, "--worker", str(tmp_path)], nproc=2, cwd=REPO,
                          env={"RELAY_METRICS_DIR": str(tmp_path / "metrics")})
    assert result.returncode == 0, result.stdout[-3000:]
    rank0 = torch.load(tmp_path / "rank-0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank-1.pt", weights_only=True)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"ranks disagree on {name}"

    n = len(_dataset())
    shares = [rt.shard_indices(n, rank=r, world_size=2, shuffle=True, seed=SEED, epoch=EPOCH) for r in range(2)]
    window = lambda share, k: share[k * BATCH_PER_RANK:(k + 1) * BATCH_PER_RANK]  # noqa: E731
    double_batches = [window(shares[0], k) + window(shares[1], k) for k in range(STEPS)]
    reference = _single_process_reference(double_batches)
    initial = _single_process_reference([])
    for name, value in reference.items():
        assert not torch.allclose(value, initial[name], atol=1e-4), f"{name} did not train: the check would be empty"
        torch.testing.assert_close(rank0[name], value, rtol=1e-5, atol=1e-6, msg=f"DDP differs on {name}")

    # the check can fail: one rank's half of each batch gives other parameters
    half_only = _single_process_reference([window(shares[0], k) for k in range(STEPS)])
    assert any(not torch.allclose(rank0[name], half_only[name], rtol=1e-5, atol=1e-6) for name in rank0)

    for rank in range(2):
        lines = (tmp_path / "metrics" / f"rank-{rank}.jsonl").read_text().splitlines()
        assert len(lines) == STEPS
        before, after = json.loads((tmp_path / f"threads-{rank}.json").read_text())
        assert after == before, f"rank {rank}: freeing the model ended {before - after} threads (the process group's)"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    worker(parser.parse_args().worker)
