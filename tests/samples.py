"""What a run trained on, from the records of tests/jobs/storage/stream_trainer.py (for the tests)."""
from __future__ import annotations

import json
from pathlib import Path

import chaos
from torchrelay.spec import JobSpec
from torchrelay.train.checkpoint import CheckpointStore

STEPS_PER_EPOCH = 30  # stream_job's 240 samples, 2 ranks, 4 a step


def stream_job(data_url: str, records: Path) -> JobSpec:
    """A 2-rank DDP job of stream_trainer.py: 2 epochs, async checkpoints every 5 steps, 2 restarts allowed."""
    return JobSpec.parse({"name": "stream", "entrypoint": f"python stream_trainer.py {data_url} {records}",
                          "workers": 2, "resources": {"cpu": 1}, "max_restarts": 2,
                          "checkpoint": {"every_steps": 5, "keep": 2, "async": True}})


def kill_rank_1_mid_second_epoch(c, job_id: str, checkpoints: CheckpointStore,
                                 records: Path) -> dict[int, dict[str, str]]:
    """Once a checkpoint of the second epoch is committed, SIGKILL rank 1 of attempt 1; returns the
    environment each rank of attempt 1 ran with (as stream_trainer.py wrote it to ``records``)."""
    chaos.wait_until(lambda: any(STEPS_PER_EPOCH < step and done for step, done in checkpoints.folders().items()),
                     120, "a checkpoint committed in the second epoch")
    workers = chaos.worker_pids(job_id, attempt=1)
    environments = {rank: json.loads((records / f"env-a1-rank-{rank}.json").read_text()) for rank in workers}
    assert chaos.kill(workers[1])
    return environments


def resumed_from(c, job_id: str) -> int:
    """The step attempt 2 resumed from (both ranks report it), checked to be mid-way through epoch 2."""
    found = {int(p.values["resumed_from"]) for p in c.iter_metrics(job_id) if "resumed_from" in p.values}
    assert len(found) == 1, found
    step = found.pop()
    assert STEPS_PER_EPOCH < step < 2 * STEPS_PER_EPOCH, step
    return step


def assert_each_sample_once_per_epoch(records: Path, resumed_from: int, samples: int, epochs: int) -> None:
    """What the run trained on: attempt 1's steps up to the checkpoint attempt 2 resumed from, then attempt 2's."""
    trained: dict[int, list[int]] = {epoch: [] for epoch in range(epochs)}
    for path in sorted(records.glob("rank-*.txt")):
        for line in path.read_text().splitlines():
            attempt, step, epoch, *ids = map(int, line.split())
            if attempt == 2 or step <= resumed_from:
                trained[epoch] += ids
    for epoch, ids in trained.items():
        assert sorted(ids) == list(range(samples)), (epoch, len(ids), len(set(ids)))
