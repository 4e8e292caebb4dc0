"""Elastic DDP on real processes: a warm 3-rank launch of ``tests/jobs/elastic/train.py``
(gloo on 127.0.0.1, the store hosted by the launch), one rank SIGKILLed mid-run, and a worker
that joins a running job."""
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

from torchrelay import wire
from torchrelay.agent.launcher import Launch, pick_free_port
from torchrelay.agent.zygote import Zygote

pytestmark = pytest.mark.timeout(300)
JOB = Path(__file__).resolve().parents[1] / "jobs" / "elastic"
SAMPLES, GLOBAL_BATCH, EPOCHS = 96, 12, 2


@pytest.fixture(scope="module")
def warm_zygote():
    zygote = Zygote(env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}, preload=("torch",))
    yield zygote
    zygote.close()


def elastic_launch(tmp_path: Path, zygote: Zygote, workers: int, *args: str, lo: int = 2, hi: int = 3) -> Launch:
    code = tmp_path / "code"
    shutil.copytree(JOB, code)
    (tmp_path / "out").mkdir()
    strategy = {"kind": "ddp", "elastic": {"min_workers": lo, "max_workers": hi}}
    assignment = wire.LaunchAssignment(
        launch_id=f"elastic-{os.getpid()}-{time.monotonic_ns()}", job_id="job-e", attempt=0, desired="run",
        node_rank=0, nnodes=1, nproc_per_node=workers, world_size=workers, rank_offset=0,
        entrypoint=["python", "train.py", "--step-sleep", "0.05", *args], bundle=None,
        env={"OUT": str(tmp_path / "out"), "RELAY_STRATEGY": json.dumps(strategy)},
        store_url=str(tmp_path / "store"), job_store_prefix="jobs/job-e")
    return Launch(assignment, code_dir=code, run_dir=tmp_path / "run", warm_zygote=zygote)


def lines(out: Path, member: int) -> list[dict]:
    path = out / f"member-{member}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(out: Path, member: int, step: int, launch: Launch) -> None:
    deadline = time.monotonic() + 120
    while max((x["step"] for x in lines(out, member)), default=-1) < step:
        assert launch.poll() is None, launch.poll()
        assert time.monotonic() < deadline, f"member {member} never reached step {step}"
        time.sleep(0.02)


def final_steps(out: Path, members: list[int]) -> dict[int, list[dict]]:
    """Per step, the lines of its last execution (the highest membership epoch: a step some
    members completed and then redid after a re-formation counts once, as redone)."""
    by_step: dict[int, list[dict]] = {}
    for member in members:
        for line in lines(out, member):
            by_step.setdefault(line["step"], []).append(line)
    return {s: [x for x in xs if x["epoch"] == max(y["epoch"] for y in xs)] for s, xs in by_step.items()}


def assert_exact_coverage(steps: dict[int, list[dict]]) -> None:
    per_epoch = SAMPLES // GLOBAL_BATCH
    assert sorted(steps) == list(range(EPOCHS * per_epoch))
    for epoch in range(EPOCHS):
        seen = [i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) for x in steps[s] for i in x["samples"]]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: a sample skipped or repeated"
    for s, xs in steps.items():
        assert len(xs) == len(xs[0]["members"]), f"step {s}: a member's share is missing"


def params(path: Path) -> dict:
    import torch

    return torch.load(path)


def assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_replay_matches(replay, replay_dir: Path, history: list[dict], out: Path) -> None:
    """Run ``replay`` (the same membership change replayed from the start) to its end: the
    same membership epochs as ``history``, and member 0's final parameters bit for bit."""
    replay.start("127.0.0.1", pick_free_port())
    status = replay.wait(timeout=240)
    assert status is not None and status.succeeded, status
    replayed = json.loads((replay_dir / "out" / "history-0.json").read_text())
    assert [(h["members"], h["start_step"]) for h in replayed] == [(h["members"], h["start_step"]) for h in history]
    assert_same(params(out / "final-0.pt"), params(replay_dir / "out" / "final-0.pt"))


def test_survivors_of_a_killed_rank_go_on_and_match_a_replay(tmp_path, warm_zygote, launches):
    launch = elastic_launch(tmp_path / "killed", warm_zygote, 3)
    launches.append(launch)
    launch.start("127.0.0.1", pick_free_port())
    out = tmp_path / "killed" / "out"
    wait_for_step(out, 2, 3, launch)
    pids = {int(k): v for k, v in json.loads((launch.run_dir / "ranks.json").read_text())["ranks"].items()}
    os.kill(pids[2], signal.SIGKILL)
    status = launch.wait(timeout=240)
    assert status is not None and status.succeeded, status
    assert "2 of 3 ranks returned (elastic" in status.message
    exits = {r.rank: r for r in status.ranks}
    assert exits[2].signal == signal.SIGKILL and exits[0].returned and exits[1].returned
    # the survivors never restarted: one pid each, the one the launch forked
    for member in (0, 1):
        assert {x["pid"] for x in lines(out, member)} == {pids[member]}
    steps = final_steps(out, [0, 1, 2])
    assert_exact_coverage(steps)
    history = json.loads((out / "history-0.json").read_text())
    assert [h["members"] for h in history] == [[0, 1, 2], [0, 1]]
    left_at = history[1]["start_step"]
    assert all(len(steps[s]) == (3 if s < left_at else 2) for s in steps)
    losses = [sum(x["loss"] for x in steps[s]) for s in sorted(steps)]
    assert losses[-1] < losses[0]  # the loss curve went on, it did not start over
    assert_same(params(out / "final-0.pt"), params(out / "final-1.pt"))

    # the same membership change replayed from the start: member 2 leaves before step `left_at`
    replay = elastic_launch(tmp_path / "replay", warm_zygote, 3, "--leave-at", str(left_at), "--leaver", "2")
    launches.append(replay)
    assert_replay_matches(replay, tmp_path / "replay", history, out)


def test_a_joiner_receives_the_members_state_and_trains_its_share(tmp_path, warm_zygote, launches):
    launch = elastic_launch(tmp_path, warm_zygote, 2, "--hold-at", "3", lo=1, hi=4)
    launches.append(launch)
    port = pick_free_port()
    launch.start("127.0.0.1", port)
    out = tmp_path / "out"
    wait_for_step(out, 0, 2, launch)
    joiner = subprocess.Popen([sys.executable, "train.py", "--step-sleep", "0.05", "--join", "7"],
                              cwd=tmp_path / "code", start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**os.environ, "OUT": str(out), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "OMP_NUM_THREADS": "1"})
    try:
        output, _ = joiner.communicate(timeout=240)
        assert joiner.returncode == 0, output.decode(errors="replace")
    finally:
        if joiner.poll() is None:
            os.killpg(joiner.pid, signal.SIGKILL)
            joiner.wait()
    status = launch.wait(timeout=240)
    assert status is not None and status.succeeded, status
    history = json.loads((out / "history-7.json").read_text())
    (joined,) = history
    assert joined["members"] == [0, 1, 7] and joined["epoch"] == 1
    # exactly the members' state at the step it joined: parameters, optimizer state, step
    received = params(out / "after-sync-1-7.pt")
    for member in (0, 1):
        sent = params(out / f"before-sync-1-{member}.pt")
        assert received["steps_done"] == sent["steps_done"] == joined["start_step"]
        assert_same(received["model"], sent["model"])
        assert json.dumps(received["opt"]["param_groups"]) == json.dumps(sent["opt"]["param_groups"])
        assert all(torch_equal(received["opt"]["state"][k]["momentum_buffer"], sent["opt"]["state"][k]["momentum_buffer"])
                   for k in sent["opt"]["state"])
    steps = final_steps(out, [0, 1, 7])
    assert_exact_coverage(steps)
    assert all(len(steps[s]) == (2 if s < joined["start_step"] else 3) for s in steps)
    assert_same(params(out / "final-0.pt"), params(out / "final-7.pt"))


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
