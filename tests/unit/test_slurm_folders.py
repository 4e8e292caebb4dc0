"""The Slurm executor's notes in the shared job folders, read back as written (real files)."""
from __future__ import annotations

from pathlib import Path

import pytest

from torchrelay.server.executors.slurm_batch import requeued_pointer
from torchrelay.server.executors.slurm_folders import (SlurmRun, name_adopted, read_requeued, read_run,
                                                       write_requeued, write_run)


def test_runs_and_requeues_read_back_as_written(tmp_path):
    attempt = tmp_path / "job-1" / "a3"
    assert read_run(attempt) is None and read_requeued(attempt) is None  # none written: the attempt's own run
    write_run(attempt, SlurmRun("41", str(tmp_path / "job-1" / "a2"), 1))
    write_requeued(attempt, "41", 2)
    assert read_run(attempt) == SlurmRun("41", str(tmp_path / "job-1" / "a2"), 1)
    assert read_requeued(attempt) == ("41", 2)
    assert sorted(p.name for p in attempt.iterdir()) == ["requeued.json", "slurm.json"]  # no temporary left


@pytest.mark.parametrize("text", ["", "{", "[]", '{"slurm_id": "41"}', '{"slurm_id": "41", "restart": "x"}'])
def test_a_torn_or_foreign_note_reads_as_none(tmp_path, text):
    (tmp_path / "requeued.json").write_text(text)
    (tmp_path / "slurm.json").write_text(text)
    assert read_requeued(tmp_path) is None and read_run(tmp_path) is None


def test_the_adopted_attempt_is_named_where_the_requeued_run_looks(tmp_path):
    base = tmp_path / "a2"
    name_adopted(str(base), 3, tmp_path / "a5")
    assert Path(requeued_pointer(str(base), 3)).read_text() == str(tmp_path / "a5")
    assert Path(requeued_pointer(str(base), 3)) == base / "requeued-3"
