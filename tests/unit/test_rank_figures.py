"""Each rank's share, speed and idle time: kept in the job's summary, shown by `relay status`."""
from __future__ import annotations

from torchrelay.client.cli.jobs import rank_lines
from torchrelay.server.telemetry import last_metrics
from torchrelay.wire import MetricRecord


def point(rank, step, **values):
    return MetricRecord(rank=rank, seq=step, step=step, time=float(step), values=values)


def test_last_metrics_keeps_each_ranks_newest_share_speed_and_idle():
    first = last_metrics(None, [point(0, 1, loss=2.0, share=32, idle_fraction=0.4),
                                point(1, 1, loss=2.1, share=32, idle_fraction=0.0)])
    second = last_metrics(first, [point(1, 5, loss=1.0, share=21, measured_samples_per_s=50.0, idle_fraction=0.01),
                                  point(1, 4, loss=1.1, share=32)])
    assert second["ranks"] == {"0": {"share": 32, "idle_fraction": 0.4},
                               "1": {"share": 21, "measured_samples_per_s": 50.0, "idle_fraction": 0.01}}
    assert second["step"] == 5 and second["loss"] == 1.0  # the lowest rank in the fresh points
    assert "ranks" not in last_metrics(None, [point(0, 1, loss=2.0)])  # a job without these figures


def test_rank_lines():
    assert rank_lines({"1": {"share": 21.0, "measured_samples_per_s": 49.6, "idle_fraction": 0.012},
                       "0": {"share": 43.0, "measured_samples_per_s": 101.2, "idle_fraction": 0.02}}) == [
        "rank 0:  share 43  101 samples/s  idle 2% of the step in the all-reduce",
        "rank 1:  share 21  50 samples/s  idle 1% of the step in the all-reduce"]
    assert rank_lines({"10": {"idle_fraction": 0.5}, "2": {}}) == [
        "rank 2:", "rank 10:  idle 50% of the step in the all-reduce"]
