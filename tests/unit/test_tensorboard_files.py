"""``server.tensorboard.event_files``, read back by TensorBoard's own reader."""
import math

import pytest

pytest.importorskip("tensorboard", reason="the [tensorboard] extra is not installed")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from torchrelay.server.tensorboard import FILE_NAME, event_files  # noqa: E402


def _read(tmp_path, files):
    out = {}
    for run, data in files.items():
        folder = tmp_path / run
        folder.mkdir()
        (folder / FILE_NAME).write_bytes(data)
        acc = EventAccumulator(str(folder))
        acc.Reload()
        out[run] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return out


def _pts(rank, n, scale=1.0, **extra):
    return [(rank, s, 1000.0 + s, {"loss": scale / (s + 1), **extra}) for s in range(n)]


@pytest.mark.parametrize("points, runs", [
    ([], []),
    (_pts(0, 5), ["rank-0"]),
    (_pts(0, 5) + _pts(1, 5), ["rank-0"]),                   # ranks agree: one run
    (_pts(0, 5) + _pts(1, 5, scale=2.0), ["rank-0", "rank-1"]),
    (_pts(3, 5, scale=2.0) + _pts(1, 5), ["rank-1", "rank-3"]),  # the lowest reporting rank is the base
    (_pts(0, 5) + _pts(1, 4), ["rank-0", "rank-1"]),         # different steps differ
])
def test_runs_are_per_rank_where_ranks_differ(tmp_path, points, runs):
    files = event_files(points)
    assert sorted(files) == runs
    read = _read(tmp_path, files)
    for run in runs:
        rank = int(run.split("-")[1])
        expect = [(p[1], pytest.approx(p[3]["loss"])) for p in points if p[0] == rank]
        assert read[run]["loss"] == expect


def test_every_key_is_a_scalar_and_nan_survives(tmp_path):
    points = [(0, 0, 1.0, {"loss": 1.0, "lr": 0.1}), (0, 1, 2.0, {"loss": math.nan}), (0, 2, 3.0, {"lr": 0.05})]
    read = _read(tmp_path, event_files(points))["rank-0"]
    assert [s for s, _ in read["loss"]] == [0, 1] and math.isnan(read["loss"][1][1])
    assert read["lr"] == [(0, pytest.approx(0.1)), (2, pytest.approx(0.05))]
