"""The zygote on real processes: a worker it forked outlives neither the zygote nor the
agent's close, a dead zygote is replaced, and launches it must not fork start as processes."""
from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from torchrelay import wire
from torchrelay.agent.launcher import Launch, pick_free_port
from torchrelay.agent.zygote import Zygote

pytestmark = pytest.mark.timeout(60)

HANG = """
import time
print("ready", flush=True)
time.sleep(600)
"""


def launch_of(tmp_path: Path, zygote: Zygote, script: str, name: str, env: dict | None = None) -> Launch:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / f"{name}.py").write_text(textwrap.dedent(script))
    assignment = wire.LaunchAssignment(
        launch_id=f"{name}-{os.getpid()}-{time.monotonic_ns()}", job_id="job-z", attempt=0, desired="run",
        node_rank=0, nnodes=1, nproc_per_node=1, world_size=1, rank_offset=0,
        entrypoint=["python", f"{name}.py"], bundle=None, env=env or {}, store_url=str(tmp_path / "store"),
        job_store_prefix="jobs/job-z")
    return Launch(assignment, code_dir=code, run_dir=tmp_path / name, zygote=zygote)


def wait_ready(launch: Launch) -> None:
    deadline = time.monotonic() + 30
    while "ready" not in [r.text for r in launch.take_logs()]:
        assert launch.poll() is None, launch.poll()
        assert time.monotonic() < deadline, "the worker never got ready"
        time.sleep(0.05)


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def zygote():
    zygote = Zygote(env={**os.environ, "PYTHONUNBUFFERED": "1"})
    yield zygote
    zygote.close()


def test_a_dead_zygote_takes_its_workers_and_is_replaced(tmp_path, zygote):
    launch = launch_of(tmp_path, zygote, HANG, "hang")
    launch.start("127.0.0.1", pick_free_port())
    assert launch.forked
    wait_ready(launch)
    first_zygote = zygote.pid
    os.kill(first_zygote, signal.SIGKILL)
    status = launch.wait(timeout=30)
    assert status is not None and status.succeeded is False
    assert status.ranks[0].signal == signal.SIGKILL
    assert group_gone(launch.pid)
    again = launch_of(tmp_path, zygote, "print('second')", "second")
    again.start("127.0.0.1", pick_free_port())
    status = again.wait(timeout=30)
    assert again.forked and zygote.pid != first_zygote
    assert status is not None and status.succeeded is True and status.ranks[0].last_lines == ["second"]


def test_close_ends_the_workers_it_forked(tmp_path, zygote):
    launch = launch_of(tmp_path, zygote, HANG, "hang")
    launch.start("127.0.0.1", pick_free_port())
    wait_ready(launch)
    zygote_proc = zygote._proc
    zygote.close()
    assert zygote_proc.poll() is not None
    status = launch.wait(timeout=30)
    assert status is not None and status.ranks[0].signal == signal.SIGKILL
    assert group_gone(launch.pid) and launch.remaining_processes() == []


def test_a_job_that_changes_the_start_up_environment_is_started_not_forked(tmp_path, zygote):
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "helper_mod.py").write_text("VALUE = 42\n")
    launch = launch_of(tmp_path, zygote, "import helper_mod; print(helper_mod.VALUE)", "uses_path",
                       env={"PYTHONPATH": str(tmp_path / "extra")})
    launch.start("127.0.0.1", pick_free_port())
    status = launch.wait(timeout=30)
    assert launch.forked is False
    assert status is not None and status.succeeded is True and status.ranks[0].last_lines == ["42"]
