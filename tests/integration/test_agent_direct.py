"""The direct launch of a world of one (no torchrun) on real processes, both ways: forked by
the zygote and started as a fresh process. The environment torchrun would give, logs, metrics
and markers as under the supervisor, a real gloo group of one, the exit hook's verdicts, and a
stop that leaves no process behind."""
from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from torchrelay import wire
from torchrelay.agent.backends import BackendKind
from torchrelay.agent.launcher import Launch, pick_free_port
from torchrelay.agent.zygote import Zygote

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def shared_zygote():
    zygote = Zygote(env={**os.environ, "PYTHONUNBUFFERED": "1"})
    yield zygote
    zygote.close()
    assert zygote._proc is None or zygote._proc.poll() is not None


@pytest.fixture(params=["forked", "fresh"])
def zygote(request, shared_zygote):
    return shared_zygote if request.param == "forked" else None


def make_launch(tmp_path: Path, script: str, *entrypoint: str, zygote: Zygote | None = None) -> Launch:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "job.py").write_text(textwrap.dedent(script))
    assignment = wire.LaunchAssignment(
        launch_id=f"direct-{os.getpid()}-{time.monotonic_ns()}", job_id="job-1", attempt=2, desired="run",
        node_rank=0, nnodes=1, nproc_per_node=1, world_size=1, rank_offset=0,
        entrypoint=list(entrypoint) or ["python", "job.py"], bundle=None, env={"JOB_VAR": "x"},
        store_url=str(tmp_path / "store"), job_store_prefix="jobs/job-1")
    launch = Launch(assignment, code_dir=code, run_dir=tmp_path / "run", relay_address="http://127.0.0.1:9",
                    zygote=zygote)
    assert launch.kind is (BackendKind.ZYGOTE if zygote is not None else BackendKind.DIRECT)
    return launch



def start(launches, launch: Launch, port: int | None = None) -> None:
    launches.append(launch)
    launch.start("127.0.0.1", port or pick_free_port())
    python_entrypoint = launch.assignment.entrypoint[0] == "python"
    assert launch.forked is (launch.kind is BackendKind.ZYGOTE and python_entrypoint)


ENV_AND_METRICS = """
import json, os, sys, time
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "RELAY_LAUNCH_ID", "RELAY_ATTEMPT",
        "JOB_VAR", "OMP_NUM_THREADS", "PYTHONUNBUFFERED"]
# one write per line: under PYTHONUNBUFFERED print() writes each argument and the newline
# apart, and the supervisor writes one stream's unterminated rest as a line of its own when it
# reads the other stream between the pieces (kept so: a line printed before a traceback stays
# before it)
sys.stdout.write(json.dumps({k: os.environ.get(k) for k in keys}) + "\\n")
sys.stderr.write("to stderr\\n")
with open(os.path.join(os.environ["RELAY_METRICS_DIR"], "rank-0.jsonl"), "a") as fh:
    fh.write(json.dumps({"step": 1, "time": time.time(), "values": {"loss": 0.5}}) + "\\n")
sys.stdout.write(f"{'main' if __name__ == '__main__' else __name__} {sys.argv[1:]}\\n")
"""


def test_success_with_torchrun_environment_logs_and_metrics(tmp_path, launches, zygote):
    launch = make_launch(tmp_path, ENV_AND_METRICS, "python", "job.py", "--x", zygote=zygote)
    port = pick_free_port()
    start(launches, launch, port)
    status = launch.wait(timeout=30)
    assert status is not None and status.succeeded is True and status.stopped is False, status
    logs = launch.take_logs()
    stdout = [r.text for r in logs if r.stream == "stdout"]
    assert [r.text for r in logs if r.stream == "stderr"] == ["to stderr"]
    assert json.loads(stdout[0]) == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_RESTART_COUNT": "0", "RELAY_LAUNCH_ID": launch.launch_id, "RELAY_ATTEMPT": "2",
        "JOB_VAR": "x", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    assert stdout[1] == "main ['--x']"  # run as __main__ with its argv, under the hook
    assert [(m.rank, m.step, m.values) for m in launch.take_metrics()] == [(0, 1, {"loss": 0.5})]
    (rank,) = status.ranks
    assert (rank.rank, rank.returned, rank.exit_code, rank.signal) == (0, True, 0, None)
    marker = json.loads((tmp_path / "run" / "status" / "rank-0.json").read_text())
    assert marker["final"] is True and marker["returned"] is True
    assert not (tmp_path / "run" / "torchrun.log").exists()
    assert "job.py" in (tmp_path / "run" / "launch.log").read_text()


GLOO_OF_ONE = """
import torch, torch.distributed as dist
import torchrelay.train as rt
ctx = rt.init()
t = torch.tensor([2.0])
dist.all_reduce(t)
print("world", dist.get_world_size(), "rank", dist.get_rank(), "sum", t.item(), "distributed", ctx.distributed)
rt.shutdown()
"""


@pytest.mark.parametrize("forked", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_gloo_group_of_one_forms_without_torchrun(tmp_path, launches, shared_zygote, forked):
    # torchrun's store is gone: rank 0 must host the env:// store on MASTER_PORT itself
    launch = make_launch(tmp_path, GLOO_OF_ONE, zygote=shared_zygote if forked else None)
    start(launches, launch)
    status = launch.wait(timeout=50)
    assert status is not None and status.succeeded is True, status
    assert "world 1 rank 0 sum 2.0 distributed True" in status.ranks[0].last_lines


@pytest.mark.parametrize("script, entrypoint, code, sig, returned, succeeded", [
    ("import sys; sys.exit(3)", (), 3, None, False, False),
    ("raise RuntimeError('boom')", (), 1, None, False, False),
    ("", ("python", "-c", "import sys; sys.exit(4)"), 4, None, False, False),          # a program
    ("", ("python", "-c", "import sys; print(sys.argv); 1/0", "a"), 1, None, False, False),
    ("", ("no-such-program-here",), 127, None, False, False),                         # cannot start
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", (), None, 9, False, False),
    # an abort during shutdown after the script returned: the rank still succeeded
    ("import atexit, os; atexit.register(os.abort)", (), None, 6, True, True),
])
def test_exit_verdicts_as_under_the_supervisor(tmp_path, launches, zygote, script, entrypoint, code, sig,
                                               returned, succeeded):
    launch = make_launch(tmp_path, script, *entrypoint, zygote=zygote)
    start(launches, launch)
    status = launch.wait(timeout=30)
    assert status is not None and status.succeeded is succeeded, status
    (rank,) = status.ranks
    assert (rank.exit_code, rank.signal, rank.returned) == (code, sig, returned)
    if code == 127:
        assert "cannot start 'no-such-program-here'" in rank.last_lines[-1]
    if code == 1 and entrypoint:  # as `python -c` shows it: its argv, its traceback
        assert "['-c', 'a']" in rank.last_lines
        assert [line for line in rank.last_lines if line != "['-c', 'a']"][-2:] == [
            '  File "<string>", line 1, in <module>', "ZeroDivisionError: division by zero"]
    elif code == 1:  # the traceback as python shows it, without the hook's or the zygote's frames
        assert rank.last_lines[-4:-3] == ["Traceback (most recent call last):"]
        assert rank.last_lines[-3].endswith('job.py", line 1, in <module>')
        assert rank.last_lines[-2:] == ["    raise RuntimeError('boom')", "RuntimeError: boom"]
    if returned and sig:
        assert "died of signal 6 during shutdown; counted as success" in rank.last_lines[-1]


HANG_WITH_CHILD = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
if os.fork() == 0:  # a forked child: under the zygote it has no RELAY_LAUNCH_ID in /proc
    time.sleep(600)
print("ready", child.pid, flush=True)
time.sleep(600)
"""


def test_stop_ends_the_worker_and_its_children(tmp_path, launches, zygote):
    launch = make_launch(tmp_path, HANG_WITH_CHILD, zygote=zygote)
    start(launches, launch)
    deadline = time.monotonic() + 30
    lines: list[str] = []
    while not any(line.startswith("ready") for line in lines):
        assert launch.poll() is None, launch.poll()
        assert time.monotonic() < deadline, "the worker never got ready"
        lines += [r.text for r in launch.take_logs()]
        time.sleep(0.05)
    pids = launch.remaining_processes()
    assert launch.pid in pids and len(pids) >= 2  # the worker and its children, no torchrun
    status = launch.stop(grace_s=5)
    assert status.stopped is True and status.succeeded is False
    assert status.ranks[0].signal == 15 and status.message.startswith("stopped: rank 0: signal 15")
    assert launch.remaining_processes() == []
    with pytest.raises(ProcessLookupError):
        os.killpg(launch.pid, 0)  # the forked child too, though no environment names it
    assert launch.stop(grace_s=5) is status  # idempotent


def test_stop_before_start(tmp_path):
    launch = make_launch(tmp_path, "")
    status = launch.stop(grace_s=1)
    assert status.stopped is True and status.succeeded is False
    with pytest.raises(RuntimeError, match="already started or stopped"):
        launch.start("127.0.0.1", pick_free_port())
