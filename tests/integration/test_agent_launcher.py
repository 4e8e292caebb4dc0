"""The launcher with real torchrun and gloo on 127.0.0.1 (2 ranks): success with logs and
metrics, a failing rank, and a stop mid-run that leaves no process behind."""
from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from torchrelay import wire
from torchrelay.agent.backends import BackendKind
from torchrelay.agent.launcher import Launch, pick_free_port
from torchrelay.agent.processes import find_launch_processes

pytestmark = pytest.mark.timeout(180)

TRAIN = """
import json, os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
metrics = os.path.join(os.environ["RELAY_METRICS_DIR"], f"rank-{os.environ['RANK']}.jsonl")
for step in range(3):
    t = torch.tensor([float(rank + step)])
    dist.all_reduce(t)
    print(f"rank {rank} step {step} sum {t.item():g}", flush=True)
    with open(metrics, "a") as fh:
        fh.write(json.dumps({"step": step, "time": time.time(), "values": {"sum": t.item()}}) + "\\n")
print(f"rank {rank} warns", file=sys.stderr, flush=True)
if "fail" in sys.argv and rank == 1:
    print("rank 1 gives up", flush=True)
    sys.exit(3)
if "fail" in sys.argv:
    # rank 0 waits to be torn down by torchrun after rank 1's exit, rather than racing it into
    # destroy_process_group (where a closed peer can fail it first on a loaded machine)
    time.sleep(600)
if "hang" in sys.argv:
    print(f"rank {rank} ready", flush=True)
    time.sleep(600)
dist.destroy_process_group()
"""


def make_launch(tmp_path: Path, *args: str, launch_id: str) -> Launch:
    """A 2-rank torchrun launch of TRAIN whose processes see ``tmp_path/tmp`` as the temp folder."""
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text(textwrap.dedent(TRAIN))
    assignment = wire.LaunchAssignment(
        launch_id=launch_id, job_id="job-1", attempt=1, desired="run", node_rank=0, nnodes=1,
        nproc_per_node=2, world_size=2, rank_offset=0, entrypoint=["python", "train.py", *args],
        bundle=None, store_url=str(tmp_path / "store"), job_store_prefix="jobs/job-1")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return Launch(assignment, code_dir=code, run_dir=tmp_path / "run", relay_address="http://127.0.0.1:9",
                  base_env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})



def unique_id(name: str) -> str:
    return f"{name}-{os.getpid()}-{time.monotonic_ns()}"


def test_success_with_logs_and_metrics(tmp_path, launches):
    launch = make_launch(tmp_path, launch_id=unique_id("ok"))
    launches.append(launch)
    launch.start("127.0.0.1", pick_free_port())
    status = launch.wait(timeout=150)
    assert status is not None, "launch did not finish"
    assert status.succeeded is True and status.stopped is False, status
    assert [(r.rank, r.returned, r.exit_code, r.signal) for r in status.ranks] == \
        [(0, True, 0, None), (1, True, 0, None)]
    # stdout and stderr are two pipes: lines keep their order within a stream, not across them
    steps = [f"rank 1 step {s} sum {2 * s + 1}" for s in range(3)]
    assert sorted(status.ranks[1].last_lines) == sorted(steps + ["rank 1 warns"])
    assert [line for line in status.ranks[1].last_lines if line in steps] == steps

    logs = launch.take_logs()
    by_key: dict[tuple[int, str], list[wire.LogRecord]] = {}
    for record in logs:
        by_key.setdefault((record.rank, record.stream), []).append(record)
    for rank in (0, 1):
        out = by_key[(rank, "stdout")]
        assert [r.text for r in out] == [f"rank {rank} step {s} sum {2 * s + 1}" for s in range(3)]
        assert [r.seq for r in out] == [0, 1, 2]
        assert [r.text for r in by_key[(rank, "stderr")]] == [f"rank {rank} warns"]
        assert all(r.attempt == 1 for r in out)
    metrics = launch.take_metrics()
    assert sorted((m.rank, m.seq, m.step, m.values["sum"]) for m in metrics) == \
        [(rank, s, s, float(2 * s + 1)) for rank in (0, 1) for s in range(3)]
    assert launch.take_logs() == [] and launch.take_metrics() == []  # nothing sent twice
    assert launch.remaining_processes() == []
    # torchrun's own files (the workers' error files) are the launch's, not a temp folder's for good
    assert list((tmp_path / "tmp").iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "run" / "torchrun").glob("*/attempt_0/*")) == ["0", "1"]


def test_failing_rank_reports_its_code_and_last_lines(tmp_path, launches):
    launch = make_launch(tmp_path, "fail", launch_id=unique_id("fail"))
    launches.append(launch)
    launch.start("127.0.0.1", pick_free_port())
    status = launch.wait(timeout=150)
    assert status is not None and status.succeeded is False and status.stopped is False
    first = status.ranks[0]  # the root cause comes first
    assert (first.rank, first.exit_code, first.returned) == (1, 3, False)
    assert set(first.last_lines[-2:]) == {"rank 1 warns", "rank 1 gives up"}  # two pipes: either order
    assert "rank 1: exit code 3" in status.message
    assert launch.remaining_processes() == []


def test_stop_mid_run_leaves_no_process(tmp_path, launches):
    launch = make_launch(tmp_path, "hang", launch_id=unique_id("stop"))
    launches.append(launch)
    launch.start("127.0.0.1", pick_free_port())
    ready: set[int] = set()
    deadline = time.monotonic() + 150
    while ready != {0, 1}:
        assert launch.poll() is None, launch.poll()
        assert time.monotonic() < deadline, "workers never got ready"
        ready |= {r.rank for r in launch.take_logs() if r.text.endswith("ready")}
        time.sleep(0.1)
    pids = find_launch_processes(launch.launch_id, launch.run_dir)
    groups = {os.getpgid(pid) for pid in pids}
    assert launch.kind is BackendKind.TORCHRUN
    assert launch.pid in pids and len(groups) >= 3  # torchrun's session + one per worker

    status = launch.stop(grace_s=5)
    assert status.stopped is True and status.succeeded is False
    assert all(not r.returned for r in status.ranks)
    assert launch.remaining_processes() == []
    for pgid in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
    assert launch.stop(grace_s=5) is status  # idempotent


def test_stop_before_start(tmp_path):
    launch = make_launch(tmp_path, launch_id=unique_id("never"))
    status = launch.stop(grace_s=1)
    assert status.stopped is True and status.succeeded is False
    assert status.message == "stopped before torchrun started"
    with pytest.raises(RuntimeError, match="already started or stopped"):
        launch.start("127.0.0.1", pick_free_port())


def test_two_nodes_rendezvous_with_global_ranks(tmp_path):
    """Two launches as node 0 and node 1 (one worker each): static rendezvous on node 0's
    port, and each node reports its rank under the global number."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(textwrap.dedent(TRAIN))
    port = pick_free_port()
    nodes = []
    for node_rank in (0, 1):
        assignment = wire.LaunchAssignment(
            launch_id=unique_id(f"node{node_rank}"), job_id="job-2", attempt=0, desired="run",
            node_rank=node_rank, nnodes=2, nproc_per_node=1, world_size=2, rank_offset=node_rank,
            entrypoint=["python", "train.py"], bundle=None, store_url=str(tmp_path / "store"),
            job_store_prefix="jobs/job-2")
        nodes.append(Launch(assignment, code_dir=code, run_dir=tmp_path / f"node{node_rank}"))
    try:
        for launch in nodes:
            launch.start("127.0.0.1", port)
        statuses = [launch.wait(timeout=150) for launch in nodes]
        for node_rank, status in enumerate(statuses):
            assert status is not None and status.succeeded is True, status
            (rank_exit,) = status.ranks
            assert rank_exit.rank == node_rank and rank_exit.returned
            assert rank_exit.last_lines[0] == f"rank {node_rank} step 0 sum 1"
    finally:
        for launch in nodes:
            launch.stop(grace_s=2)
            assert launch.remaining_processes() == []
