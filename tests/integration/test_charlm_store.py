"""examples/charlm from a store: pack.py writes a text's windows as shards in a folder store;
train.py --data URL streams them (rt.stream) on two gloo ranks under torchrun, learns, trains
on every window once per epoch, and a run stopped mid-epoch resumes from its checkpoint at the
next window."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
CHARLM = REPO / "examples" / "charlm"
CONTEXT = 32


def run_torchrun(*args, **kwargs):
    """The tests' owned torchrun (tests/torchrun_helper.py)."""
    from torchrun_helper import run_torchrun as run

    return run(*args, **kwargs)


def _job_env(tmp_path: Path, attempt: int) -> dict[str, str]:
    return {"RELAY_STORE_URL": f"file://{tmp_path / 'store'}", "RELAY_JOB_ID": "j-charlm",
            "RELAY_JOB_STORE_PREFIX": "jobs/j-charlm", "RELAY_ATTEMPT": str(attempt),
            "RELAY_METRICS_DIR": str(tmp_path / f"metrics-{attempt}"), "RELAY_OUTPUT_DIR": str(tmp_path / "out"),
            "RELAY_STRATEGY": json.dumps({"kind": "ddp"}), "RELAY_CHECKPOINT": json.dumps({"every_steps": 10, "keep": 2})}


def _packed(tmp_path: Path) -> tuple[Path, dict]:
    """A ~13 k character text (a piece of Python's own argparse) packed into a folder store."""
    import argparse
    import inspect

    text = tmp_path / "corpus.txt"
    text.write_text(inspect.getsource(argparse)[:13_000], encoding="utf-8")
    data = tmp_path / "charlm-data"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    packed = subprocess.run([sys.executable, "pack.py", str(data), "--text", str(text), "--context", str(CONTEXT),
                             "--shard-size", "8KiB"], cwd=CHARLM, env=env, capture_output=True, text=True, timeout=120)
    assert packed.returncode == 0, packed.stderr[-3000:]
    meta = json.loads((data / "corpus.json").read_text())
    assert meta["context"] == CONTEXT and len(list(data.glob("shard-*.pt"))) > 3  # several shards to plan over
    return data, meta


def _train(data: Path, tmp_path: Path, attempt: int, *extra: str):
    result = run_torchrun(["train.py", "--data", str(data), "--epochs", "2", "--batch-size", "8", "--eval-every", "10",
                           "--val-batches", "2", "--record-windows", str(tmp_path / f"windows-{attempt}"), *extra],
                          nproc=2, cwd=CHARLM, env=_job_env(tmp_path, attempt), timeout=200)
    assert result.returncode == 0, result.stdout[-3000:]
    return result


def _windows(folder: Path) -> list[tuple[int, int, int, list[int]]]:
    """(rank, epoch, step, window starts) of every step a rank trained."""
    rows = []
    for rank in range(2):
        for line in (folder / f"rank-{rank}.txt").read_text().splitlines():
            epoch, step, *starts = map(int, line.split())
            rows.append((rank, epoch, step, starts))
    return rows


def _assert_each_window_once_per_epoch(rows, windows: int) -> None:
    everything = set(range(0, windows * CONTEXT, CONTEXT))
    for epoch in range(2):
        seen = Counter(s for _rank, e, _step, starts in rows if e == epoch for s in starts)
        assert max(seen.values()) == 1, [s for s, n in seen.items() if n > 1]
        # even=True: the last windows % 2 sit the epoch out, so both ranks take the same steps
        assert set(seen) <= everything and len(everything - set(seen)) == windows % 2, (epoch, len(seen), windows)


def test_charlm_trains_from_a_packed_store_on_two_ranks(tmp_path):
    data, meta = _packed(tmp_path)
    result = _train(data, tmp_path, 0)
    assert "final val_loss=" in result.stdout
    rows = _windows(tmp_path / "windows-0")
    _assert_each_window_once_per_epoch(rows, meta["windows"]["train"])
    steps_per_epoch = meta["windows"]["train"] // 2 // 8 + (meta["windows"]["train"] // 2 % 8 > 0)
    assert sorted(step for rank, _e, step, _s in rows if rank == 1) == list(range(1, 2 * steps_per_epoch + 1))

    losses = [r["values"]["loss"] for r in map(json.loads, (tmp_path / "metrics-0" / "rank-0.jsonl").read_text()
                                                .splitlines()) if "loss" in r["values"]]
    assert len(losses) == 2 * steps_per_epoch
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.8, losses  # it learns (from ~ln(vocab) = 4.4 nats)


@pytest.mark.slow  # two torchrun launches (~50 s): make test-all
def test_charlm_from_a_store_resumes_mid_epoch_at_the_next_window(tmp_path):
    data, meta = _packed(tmp_path)
    _train(data, tmp_path, 0, "--steps", "30")  # stops in the second epoch; checkpoints at steps 10, 20, 30
    resumed = _train(data, tmp_path, 1)
    assert "resumed from the checkpoint at step 30 (epoch 2)" in resumed.stdout, resumed.stdout[-2000:]
    first, second = _windows(tmp_path / "windows-0"), _windows(tmp_path / "windows-1")
    assert max(step for _rank, _epoch, step, _starts in first) == 30
    assert min(step for _rank, _epoch, step, _starts in second) == 31
    _assert_each_window_once_per_epoch(first + second, meta["windows"]["train"])
