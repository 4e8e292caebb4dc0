"""examples/charlm/train.py under torchrun on two gloo ranks, as a user starts it (slow)."""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHARLM = REPO / "examples" / "charlm"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ['{"kind": "local_sgd", "every": 4}', '{"kind": "final_average"}'])
def test_train_script_runs_under_torchrun_with_a_strategy(tmp_path, strategy):
    spec = importlib.util.spec_from_file_location("charlm_data_torchrun", CHARLM / "data.py")
    data = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up there
    spec.loader.exec_module(data)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(data.stdlib_text(), encoding="utf-8")  # a text that ships with Python
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RELAY_STRATEGY": strategy, "RELAY_OUTPUT_DIR": str(tmp_path),
           "RELAY_METRICS_DIR": str(tmp_path / "metrics")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "--log-dir", str(tmp_path / "torchrun"), "train.py", "--data", str(corpus), "--steps", "24",
           "--eval-every", "12", "--val-batches", "2"]
    proc = subprocess.Popen(cmd, cwd=CHARLM, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "final val_loss=" in out
    metrics = (tmp_path / "metrics").rglob("*")
    text = "".join(p.read_text() for p in metrics if p.is_file())
    assert "bytes_sent" in text
