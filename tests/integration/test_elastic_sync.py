"""Elastic local SGD and DiLoCo on real processes: a warm 3-rank launch of
``tests/jobs/elastic/train_sync.py`` (gloo on 127.0.0.1, the store hosted by the launch), one
rank SIGKILLed mid-run, and a worker that joins a running DiLoCo job at a sync point."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_elastic import (assert_exact_coverage, assert_replay_matches, assert_same, final_steps,
                                            lines, params, wait_for_step)
from torchrelay import wire
from torchrelay.agent.launcher import Launch, pick_free_port
from torchrelay.agent.zygote import Zygote

pytestmark = pytest.mark.timeout(300)
JOB = Path(__file__).resolve().parents[1] / "jobs" / "elastic"
STRATEGIES = {"local_sgd": {"kind": "local_sgd", "every": 3, "warmup_steps": 2},
              "diloco": {"kind": "diloco", "every": 3, "outer_lr": 0.5, "outer_momentum": 0.5}}  # 0.9 overshoots here


@pytest.fixture(scope="module")
def warm_zygote():
    zygote = Zygote(env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}, preload=("torch",))
    yield zygote
    zygote.close()


def sync_launch(tmp_path: Path, zygote: Zygote, kind: str, workers: int, *args: str, lo: int = 2,
                hi: int = 3) -> Launch:
    code = tmp_path / "code"
    shutil.copytree(JOB, code)
    (tmp_path / "out").mkdir()
    strategy = {**STRATEGIES[kind], "elastic": {"min_workers": lo, "max_workers": hi}}
    assignment = wire.LaunchAssignment(
        launch_id=f"elastic-sync-{os.getpid()}-{time.monotonic_ns()}", job_id="job-es", attempt=0, desired="run",
        node_rank=0, nnodes=1, nproc_per_node=workers, world_size=workers, rank_offset=0,
        entrypoint=["python", "train_sync.py", "--step-sleep", "0.03", *args], bundle=None,
        env={"OUT": str(tmp_path / "out"), "RELAY_STRATEGY": json.dumps(strategy)},
        store_url=str(tmp_path / "store"), job_store_prefix="jobs/job-es")
    return Launch(assignment, code_dir=code, run_dir=tmp_path / "run", warm_zygote=zygote)


@pytest.mark.parametrize("kind", ["local_sgd", "diloco"])
def test_survivors_redo_the_period_and_match_a_replay(tmp_path, warm_zygote, launches, kind):
    launch = sync_launch(tmp_path / "killed", warm_zygote, kind, 3)
    launches.append(launch)
    launch.start("127.0.0.1", pick_free_port())
    out = tmp_path / "killed" / "out"
    wait_for_step(out, 2, 6, launch)  # 7 steps done: inside a period (sync points: local_sgd 5, 8; diloco 6, 9)
    pids = {int(k): v for k, v in json.loads((launch.run_dir / "ranks.json").read_text())["ranks"].items()}
    os.kill(pids[2], signal.SIGKILL)
    status = launch.wait(timeout=240)
    assert status is not None and status.succeeded, status
    assert "2 of 3 ranks returned (elastic" in status.message
    for member in (0, 1):  # the survivors never restarted
        assert {x["pid"] for x in lines(out, member)} == {pids[member]}
    history = json.loads((out / "history-0.json").read_text())
    assert [h["members"] for h in history] == [[0, 1, 2], [0, 1]]
    resumed_at = history[1]["start_step"]
    warmup, every = STRATEGIES[kind].get("warmup_steps", 0), STRATEGIES[kind]["every"]
    assert resumed_at >= 5 and (resumed_at - warmup) % every == 0  # back to the last sync point, not the start
    for member in (0, 1):  # each went back to exactly its own state at that sync point, inner optimizer's too
        assert same_state(params(out / f"state-1-{member}.pt"), params(out / f"anchor-0-{resumed_at}-{member}.pt"))
    steps = final_steps(out, [0, 1, 2])
    assert_exact_coverage(steps)  # the dead member's samples of the lost period were trained again
    assert all(len(steps[s]) == (3 if s < resumed_at else 2) for s in steps)
    losses = [sum(x["loss"] for x in steps[s]) / len(steps[s]) for s in sorted(steps)]
    assert sum(losses[-4:]) / 4 < sum(losses[:3]) / 3  # the curve went on (each member's loss is on 4-6 samples)
    assert_same(params(out / "final-0.pt"), params(out / "final-1.pt"))

    # replayed from the start: member 2 leaves right after the sync point the survivors went back to
    replay = sync_launch(tmp_path / "replay", warm_zygote, kind, 3, "--leave-at", str(resumed_at), "--leaver", "2")
    launches.append(replay)
    assert_replay_matches(replay, tmp_path / "replay", history, out)


def test_a_diloco_joiner_receives_the_sync_point_state(tmp_path, warm_zygote, launches):
    launch = sync_launch(tmp_path, warm_zygote, "diloco", 2, "--hold-at", "4", lo=1, hi=4)
    launches.append(launch)
    port = pick_free_port()
    launch.start("127.0.0.1", port)
    out = tmp_path / "out"
    wait_for_step(out, 0, 3, launch)  # the members hold before their 5th step: the joiner enters at 6
    joiner = subprocess.Popen([sys.executable, "train_sync.py", "--step-sleep", "0.03", "--join", "7"],
                              cwd=tmp_path / "code", start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**os.environ, "OUT": str(out), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "OMP_NUM_THREADS": "1", "RELAY_STRATEGY": json.dumps(STRATEGIES["diloco"])})
    try:
        output, _ = joiner.communicate(timeout=240)
        assert joiner.returncode == 0, output.decode(errors="replace")
    finally:
        if joiner.poll() is None:
            os.killpg(joiner.pid, signal.SIGKILL)
            joiner.wait()
    status = launch.wait(timeout=240)
    assert status is not None and status.succeeded, status
    (joined,) = json.loads((out / "history-7.json").read_text())
    assert joined["members"] == [0, 1, 7] and joined["start_step"] == 6  # the first sync point after the hold
    received, source, other = (params(out / f"state-1-{m}.pt") for m in (7, 0, 1))
    # the sync point's state, the same on every member: parameters, step, DiLoCo's global
    # parameters and outer momentum
    for sent in (source, other):
        assert_same(received["model"], sent["model"])
        assert received["opt"]["sync"]["steps_done"] == sent["opt"]["sync"]["steps_done"] == 6
        (mine,), (theirs,) = received["opt"]["sync"]["rules"], sent["opt"]["sync"]["rules"]
        assert all(equal(a, b) for a, b in zip(mine["global_params"], theirs["global_params"]))
        outer = theirs["outer_optimizer"]["state"]
        assert outer and all(equal(mine["outer_optimizer"]["state"][k]["momentum_buffer"], v["momentum_buffer"])
                             for k, v in outer.items())
    # the inner optimizer's state is each replica's own: the joiner's is the source's (member 0)
    inner = source["opt"]["inner"]["state"]
    assert inner and all(equal(received["opt"]["inner"]["state"][k]["momentum_buffer"], v["momentum_buffer"])
                         for k, v in inner.items())
    steps = final_steps(out, [0, 1, 7])
    assert_exact_coverage(steps)
    assert all(len(steps[s]) == (2 if s < 6 else 3) for s in steps)
    assert_same(params(out / "final-0.pt"), params(out / "final-7.pt"))


def same_state(a, b) -> bool:
    """Nested state dicts equal, tensors bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return equal(a, b) if hasattr(a, "shape") else a == b


def equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
