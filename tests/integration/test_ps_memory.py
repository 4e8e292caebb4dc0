"""Parameter-server workers report the ``memory_*`` figures every data-parallel strategy reports: real worker and
server processes on 127.0.0.1 (``test_ps_job.py``, started as ``test_ps_training``'s ``Job`` does)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ps_training import job, ps_strategy  # noqa: E402,F401  (the fixture that starts and owns the processes)

pytestmark = pytest.mark.timeout(120)

# test_ps_job.py's model: Linear(64, 32), ReLU, Linear(32, 10) in float32
PARAMETER_BYTES = (64 * 32 + 32 + 32 * 10 + 10) * 4


def test_workers_report_their_parameters_gradients_and_activations(job) -> None:
    cfg = {"workers": 2, "task": "equiv", "steps": 3, "batch": 16,
           "strategy": ps_strategy("sync", optimizer={"name": "adam", "lr": 0.01})}
    j = job(cfg)
    assert j.wait() == [0, 0, 0]
    for r in j.results():
        # the whole model's parameters and gradients (views of the flat buffers), no optimizer state: the
        # servers hold Adam's moments; activations as measured over the first forwards
        assert r["memory_parameters"] == r["memory_gradients"] == PARAMETER_BYTES, r
        assert r["memory_optimizer_state"] == 0
        assert r["memory_activations"] > 0
        assert r["memory_training_state"] == 2 * PARAMETER_BYTES
