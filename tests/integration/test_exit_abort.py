"""The exit-time abort (docs/design.md, "Exit-time abort with DDP on gloo"), both halves, with real torchrun and gloo.

The real abort (gloo, SIGABRT during interpreter teardown after the script returned) happens
in some runs only; a test must not pass or fail by luck, so the script here trains a real
2-rank DDP model on gloo and then leaves behind an object that aborts the process when the
interpreter's teardown collects it: the same failure, every time. ``bench/exit_abort.py``
counts the real, unforced aborts of plain DDP.

- plain torchrun: the launch fails (the ranks die of SIGABRT after returning);
- the agent's launcher: the same script succeeds every time;
- a rank that really fails (exception, or killed by a signal before its script returned)
  still fails the launch, and is named.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torchrelay import wire
from torchrelay.agent.launcher import Launch, pick_free_port

pytestmark = pytest.mark.timeout(240)

DDP_THEN_ABORT_AT_EXIT = """
import gc, os, signal, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"rank {rank} trained", flush=True)
dist.destroy_process_group()
if rank == 1 and "raise" in sys.argv:
    raise RuntimeError("rank 1 really failed")
if rank == 1 and "kill" in sys.argv:
    os.kill(os.getpid(), signal.SIGKILL)

class AbortsWhenCollected:
    # stands in for gloo's teardown abort: SIGABRT when the exit-time collection frees it
    def __init__(self):
        self.cycle = self
    def __del__(self, _abort=os.abort):
        _abort()

gc.disable()  # so that nothing collects it before the script has returned
AbortsWhenCollected()
print(f"rank {rank} returned", flush=True)
"""


def write_script(tmp_path: Path) -> Path:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text(textwrap.dedent(DDP_THEN_ABORT_AT_EXIT))
    return code


def launch_through_agent(tmp_path: Path, *args: str) -> wire.LaunchStatus:
    code = write_script(tmp_path)
    assignment = wire.LaunchAssignment(
        launch_id=f"abort-{os.getpid()}-{time.monotonic_ns()}", job_id="job-abort", attempt=0,
        desired="run", node_rank=0, nnodes=1, nproc_per_node=2, world_size=2, rank_offset=0,
        entrypoint=["python", "train.py", *args], bundle=None, store_url=str(tmp_path / "store"),
        job_store_prefix="jobs/job-abort")
    launch = Launch(assignment, code_dir=code, run_dir=tmp_path / "run")
    launch.start("127.0.0.1", pick_free_port())
    try:
        status = launch.wait(timeout=200)
        assert status is not None, "launch did not finish"
        return status
    finally:
        launch.stop(grace_s=2)
        assert launch.remaining_processes() == []


def test_plain_torchrun_fails_on_the_abort_after_return(tmp_path):
    code = write_script(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(pick_free_port()), "--max-restarts", "0", "--log-dir", str(tmp_path / "torchrun"),
         "train.py"],
        cwd=code, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=200,
        start_new_session=True)
    output = proc.stdout + proc.stderr
    assert "rank 0 returned" in output and "rank 1 returned" in output  # both scripts finished...
    assert proc.returncode != 0                                        # ...yet torchrun calls it failed
    assert "exitcode  : -6" in output and "SIGABRT" in output


def test_launcher_succeeds_when_every_script_returned(tmp_path):
    status = launch_through_agent(tmp_path)
    assert status.succeeded is True, status
    assert [(r.rank, r.returned) for r in status.ranks] == [(0, True), (1, True)]
    # the abort still happened (during the hook's gc.collect()); it came after the return
    assert {r.signal for r in status.ranks} == {6}
    assert status.ranks[0].last_lines[0] == "rank 0 trained"
    assert any("counted as success" in line for line in status.ranks[0].last_lines)


@pytest.mark.parametrize("how, code, sig, last_line", [
    # an exception is also covered without torchrun in test_agent_worker.py
    pytest.param("raise", 1, None, "RuntimeError: rank 1 really failed", marks=pytest.mark.slow),
    ("kill", None, 9, "rank 1 trained"),
])
def test_launcher_still_fails_a_rank_that_really_failed(tmp_path, how, code, sig, last_line):
    status = launch_through_agent(tmp_path, how)
    assert status.succeeded is False
    failed = status.ranks[0]
    assert (failed.rank, failed.returned, failed.exit_code, failed.signal) == (1, False, code, sig)
    assert failed.last_lines[-1] == last_line


REAL_DDP = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for _ in range(30):
    loss = torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_unforced_ddp_succeeds_every_time_through_the_launcher(tmp_path):
    """Ten plain DDP launches (the real abort hits about one in four under torchrun) all succeed."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(textwrap.dedent(REAL_DDP))
    for index in range(10):
        assignment = wire.LaunchAssignment(
            launch_id=f"real-{os.getpid()}-{index}", job_id="job-real", attempt=0, desired="run",
            node_rank=0, nnodes=1, nproc_per_node=2, world_size=2, rank_offset=0,
            entrypoint=["python", "train.py"], bundle=None, store_url=str(tmp_path / "store"),
            job_store_prefix="jobs/job-real")
        launch = Launch(assignment, code_dir=code, run_dir=tmp_path / f"run-{index}")
        launch.start("127.0.0.1", pick_free_port())
        try:
            status = launch.wait(timeout=200)
            assert status is not None and status.succeeded is True, status
        finally:
            launch.stop(grace_s=2)
