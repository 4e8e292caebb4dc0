"""torchrelay.train.report: line format, value checks, buffering and flushing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import torchrelay.train as rt
from torchrelay.train.report import MAX_BUFFERED, MetricsWriter, format_record, metric_value, metrics_path

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _clean_library_state():
    rt.shutdown()
    yield
    rt.shutdown()


@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (2.5, 2.5), (True, 1.0), (np.float32(0.25), 0.25), (np.int64(7), 7.0),
    (torch.tensor(3.5), 3.5), (torch.tensor([4.0]), 4.0), (np.array([1.5]), 1.5),
    (float("nan"), float("nan")), (float("inf"), float("inf")),
])
def test_metric_value_accepts_real_numbers(value, expected):
    got = metric_value("x", value)
    assert isinstance(got, float)
    assert got == expected or (np.isnan(expected) and np.isnan(got))


@pytest.mark.parametrize("value, fragment", [
    ("0.5", "'loss'='0.5' is a str"),
    ([1.0], "is a list"),
    (torch.tensor([1.0, 2.0]), "2 elements"),
    (None, "is a NoneType"),
    (1 + 2j, "is a complex"),
])
def test_metric_value_refuses_non_numbers_naming_the_key(value, fragment):
    with pytest.raises(TypeError) as info:
        metric_value("loss", value)
    assert fragment in str(info.value)
    assert "'loss'" in str(info.value)


@pytest.mark.parametrize("step, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("3", TypeError)])
def test_format_record_refuses_bad_steps(step, error):
    with pytest.raises(error, match="step="):
        format_record(step, 0.0, {})


def test_format_record_is_one_json_line():
    line = format_record(7, 12.5, {"loss": 0.25, "samples_per_s": 1000.0})
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line) == {"step": 7, "time": 12.5, "values": {"loss": 0.25, "samples_per_s": 1000.0}}


def _lines(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_writer_buffers_until_close(tmp_path):
    path = str(tmp_path / "m" / "rank-0.jsonl")
    ticks = iter(range(100, 200))
    writer = MetricsWriter(path, flush_interval_s=3600, clock=lambda: float(next(ticks)))
    for step in range(1, 4):
        writer.write(step, {"loss": 1.0 / step})
    assert _lines(path) == []  # still buffered: the flusher waits the (long) interval
    writer.close()
    assert _lines(path) == [{"step": s, "time": float(99 + s), "values": {"loss": 1.0 / s}} for s in range(1, 4)]
    writer.close()  # idempotent
    writer.write(4, {"loss": 0.1})  # after close: straight to the file
    assert [r["step"] for r in _lines(path)] == [1, 2, 3, 4]


def test_writer_flushes_on_its_own_after_the_interval(tmp_path):
    path = str(tmp_path / "rank-0.jsonl")
    writer = MetricsWriter(path, flush_interval_s=0.05)
    try:
        writer.write(1, {"loss": 2.0})
        deadline = time.monotonic() + 30
        while not _lines(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [r["step"] for r in _lines(path)] == [1]
        writer.write(2, {"loss": 1.0})  # the flusher keeps serving later bursts
        while len(_lines(path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [r["step"] for r in _lines(path)] == [1, 2]
    finally:
        writer.close()


def test_writer_flushes_a_full_buffer_at_once(tmp_path):
    path = str(tmp_path / "rank-0.jsonl")
    writer = MetricsWriter(path, flush_interval_s=3600)
    try:
        for step in range(MAX_BUFFERED):
            writer.write(step, {"loss": 1.0})
        assert len(_lines(path)) == MAX_BUFFERED
    finally:
        writer.close()


def test_writer_from_many_threads_writes_whole_lines(tmp_path):
    path = str(tmp_path / "rank-0.jsonl")
    writer = MetricsWriter(path, flush_interval_s=0.01)

    def work(offset: int) -> None:
        for step in range(200):
            writer.write(offset + step, {"v": float(step)})

    threads = [threading.Thread(target=work, args=(i * 1000,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    writer.close()
    steps = sorted(r["step"] for r in _lines(path))
    assert steps == sorted(i * 1000 + s for i in range(4) for s in range(200))


def test_writer_without_path_drops_but_still_checks():
    writer = MetricsWriter(None)
    writer.write(1, {"loss": 1.0})
    with pytest.raises(ValueError):
        writer.write(-1, {})
    writer.close()


def test_metrics_path_follows_the_environment():
    assert metrics_path({}, 3) is None
    assert metrics_path({"RELAY_METRICS_DIR": "/x/m"}, 3) == "/x/m/rank-3.jsonl"


class _OptimizerWithMetrics(torch.optim.SGD):
    def metrics(self) -> dict[str, float]:
        return {"sync_rounds": 4, "loss": -1.0}


def test_report_merges_optimizer_metrics_and_writes_per_rank_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_METRICS_DIR", str(tmp_path))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RELAY_STRATEGY"):
        monkeypatch.delenv(name, raising=False)
    rt.init()
    model = torch.nn.Linear(2, 1)
    model, _opt = rt.prepare(model, _OptimizerWithMetrics(model.parameters(), lr=0.1))
    rt.report(3, loss=0.5, samples_per_s=torch.tensor(100.0))
    with pytest.raises(TypeError, match="'epoch'"):
        rt.report(4, epoch="one")
    rt.shutdown()
    records = _lines(tmp_path / "rank-0.jsonl")
    assert len(records) == 1
    assert records[0]["step"] == 3
    assert records[0]["values"] == {"sync_rounds": 4.0, "loss": 0.5, "samples_per_s": 100.0}


def test_report_is_flushed_at_interpreter_exit_without_shutdown(tmp_path):
    env = {**os.environ, "RELAY_METRICS_DIR": str(tmp_path), "RANK": "1", "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    code = "import torchrelay.train as rt\nfor s in range(5): rt.report(s, loss=1.0 / (s + 1))\n"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert [r["step"] for r in _lines(tmp_path / "rank-1.jsonl")] == [0, 1, 2, 3, 4]


def test_a_failed_write_keeps_the_lines_for_the_next_flush(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    path.mkdir()  # opening it for appending fails, as a full disk or a lost mount would
    writer = MetricsWriter(str(path), flush_interval_s=3600)
    writer.write(1, {"loss": 1.0})
    writer.write(2, {"loss": 0.5})
    with pytest.raises(OSError):
        writer.flush()
    path.rmdir()
    writer.write(3, {"loss": 0.25})
    writer.close()
    assert [r["step"] for r in _lines(path)] == [1, 2, 3]
