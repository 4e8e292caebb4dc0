"""examples/digits/train.py, unchanged, on two real gloo ranks under torchrun, with a job's environment."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "digits"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digits_module():
    return _load("digits_model", DIGITS / "model.py")


def run_torchrun(*args, **kwargs):
    """The tests' owned torchrun (tests/torchrun_helper.py)."""
    from torchrun_helper import run_torchrun as run

    return run(*args, **kwargs)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_digits_as_a_job_on_two_ranks_reaches_095_and_saves_model_metrics_checkpoints(tmp_path):
    from torchrelay.storage import ArtifactStore
    from torchrelay.train.checkpoint import CheckpointStore, decode_files

    store_url = f"file://{tmp_path / 'store'}"
    env = {"RELAY_STORE_URL": store_url, "RELAY_JOB_ID": "j-digits", "RELAY_JOB_STORE_PREFIX": "jobs/j-digits",
           "RELAY_ATTEMPT": "0", "RELAY_METRICS_DIR": str(tmp_path / "metrics"),
           "RELAY_STRATEGY": json.dumps({"kind": "ddp"}),
           "RELAY_CHECKPOINT": json.dumps({"every_steps": 40, "keep": 2})}
    result = run_torchrun(["train.py"], nproc=2, cwd=DIGITS, env=env)
    # strict: shutdown() must spare a finished DDP job the gloo abort at exit (docs/design.md, exit-time abort)
    assert result.returncode == 0, result.stdout[-3000:]

    accuracy = float(re.search(r"^test_accuracy=([0-9.]+)$", result.stdout, re.M).group(1))
    assert accuracy >= 0.95, result.stdout[-2000:]
    model_url = re.search(r"^model saved to (\S+)$", result.stdout, re.M).group(1)
    assert model_url == f"{store_url}/jobs/j-digits/artifacts/model.pt"

    digits = _digits_module()
    model = digits.DigitsCNN()
    model.load_state_dict(torch.load(tmp_path / "store/jobs/j-digits/artifacts/model.pt", weights_only=True))
    _train, test = digits.load_split(0)
    with torch.no_grad():
        again = (model(test.tensors[0]).argmax(1) == test.tensors[1]).double().mean().item()
    assert f"{again:.3f}" == f"{accuracy:.3f}"

    total = None
    for rank in range(2):
        records = _records(tmp_path / "metrics" / f"rank-{rank}.jsonl")
        steps = [r for r in records if "loss" in r["values"]]
        total = int(steps[0]["values"]["total_steps"])
        assert [r["step"] for r in steps] == list(range(1, total + 1))
        assert all({"loss", "samples_per_s", "total_steps", "epoch"} <= set(r["values"]) for r in steps)
        assert all(r["values"]["samples_per_s"] > 0 for r in steps)
    assert _records(tmp_path / "metrics" / "rank-0.jsonl")[-1]["values"]["accuracy"] == pytest.approx(accuracy, abs=1e-3)

    checkpoints = CheckpointStore(ArtifactStore(store_url), "j-digits", keep=2)
    last = total // 40 * 40
    assert sorted(checkpoints.folders()) == [last - 40, last]
    loaded = checkpoints.load(decode=decode_files)
    assert loaded.step == last and loaded.skipped == [] and loaded.state["step"] == last


@pytest.mark.slow
def test_digits_resumes_from_its_newest_checkpoint(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RELAY_OUTPUT_DIR": str(tmp_path / "out"),
           "RELAY_METRICS_DIR": str(tmp_path / "metrics")}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RELAY_STORE_URL", "RELAY_JOB_ID"):
        env.pop(name, None)
    first = subprocess.run([sys.executable, "train.py", "--epochs", "1", "--checkpoint-every", "20"], cwd=DIGITS,
                           env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    second = subprocess.run([sys.executable, "train.py", "--epochs", "2", "--checkpoint-every", "20"], cwd=DIGITS,
                            env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from the checkpoint at step 40" in second.stdout
    steps = [r["step"] for r in _records(tmp_path / "metrics" / "rank-0.jsonl") if "loss" in r["values"]]
    # first run: 1..45 (one epoch of 1437 / 32); second: picks up after step 40, same data order
    assert steps == list(range(1, 46)) + list(range(41, 91))


def test_the_job_spec_asks_for_two_ddp_workers_running_train_py():
    from torchrelay.spec import JobSpec

    spec = JobSpec.from_yaml_text((DIGITS / "job.yaml").read_text())
    assert (spec.workers, spec.strategy.kind, spec.argv[:2]) == (2, "ddp", ["python", "train.py"])
    assert (DIGITS / spec.workdir / "train.py").is_file()


@pytest.mark.slow  # three epochs of training (~30 s): make test-all
def test_digits_trains_from_a_packed_store(tmp_path):
    """pack.py writes the training split as shards; train.py --data streams them (rt.stream) and
    reaches the same accuracy as from memory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RELAY_OUTPUT_DIR": str(tmp_path / "out")}
    for name in ("RELAY_STORE_URL", "RELAY_JOB_ID", "RELAY_JOB_STORE_PREFIX", "RELAY_CHECKPOINT", "RELAY_METRICS_DIR"):
        env.pop(name, None)
    data = tmp_path / "digits"
    packed = subprocess.run([sys.executable, "pack.py", str(data)], cwd=DIGITS, env=env, capture_output=True,
                            text=True, timeout=120)
    assert packed.returncode == 0 and "1437 samples" in packed.stdout, packed.stderr
    trained = subprocess.run([sys.executable, "train.py", "--data", str(data), "--epochs", "3"], cwd=DIGITS, env=env,
                             capture_output=True, text=True, timeout=200)
    assert trained.returncode == 0, trained.stderr[-3000:]
    accuracy = float(re.search(r"^test_accuracy=([0-9.]+)$", trained.stdout, re.M).group(1))
    assert accuracy >= 0.9, trained.stdout[-2000:]
