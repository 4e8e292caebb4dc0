"""The server is killed (SIGKILL) mid-job and started again on the same state: nothing is lost."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import group_members, kill_group
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobSpec, JobState

pytestmark = pytest.mark.timeout(300)
JOBS = Path(__file__).resolve().parents[1] / "jobs" / "plain"
CLI = [sys.executable, "-m", "torchrelay.client.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv, home: Path, log: str) -> subprocess.Popen:
    out = open(home / log, "ab")
    return subprocess.Popen([*CLI, *argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RELAY_HOME": str(home)})


def wait_until(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def all_logs(c, job_id):
    return [line.text for line in c.iter_logs(job_id)]


def all_metric_steps(c, job_id):
    return [p.step for p in c.iter_metrics(job_id)]


def test_kill_9_server_mid_job_then_restart(relay_home):
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    server_args = ["server", "--port", str(port), "--heartbeat-timeout", "10"]
    procs = [start(server_args, relay_home, "server.log")]
    try:
        with RelayClient(address) as c:
            wait_until(lambda: _answers(c))
            procs.append(start(["agent", "--address", address, "--name", "a0", "--cpus", "1",
                                "--work-dir", str(relay_home / "a0")], relay_home, "agent.log"))
            c.wait_for_nodes(1, timeout=60)
            first = c.submit(JobSpec.parse({"name": "first", "entrypoint": "python counter.py 80"}), base_dir=JOBS)
            second = c.submit(JobSpec.parse({"name": "second", "entrypoint": "python counter.py 5"}), base_dir=JOBS)
            wait_until(lambda: len(all_logs(c, first.id)) >= 5)
            before = [(j.id, j.name) for j in c.jobs()]
            f = c.job(first.id)
            assert c.job(second.id).state == JobState.QUEUED, (f.state, f.failure, [e.message for e in f.events])

            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(timeout=10)
            time.sleep(2)  # the job runs on, the agent buffers
            procs[0] = start(server_args, relay_home, "server.log")
            wait_until(lambda: _answers(c))

            assert [(j.id, j.name) for j in c.jobs()] == before
            assert c.wait(first.id, timeout=120).state == JobState.SUCCEEDED
            assert c.wait(second.id, timeout=120).state == JobState.SUCCEEDED
            assert all_logs(c, first.id) == [f"line {i}" for i in range(80)]
            assert sorted(all_metric_steps(c, first.id)) == list(range(80))
    finally:
        for proc in reversed(procs):
            kill_group(proc.pid)
            proc.wait(timeout=15)
            assert group_members(proc.pid) == []


def _answers(c) -> bool:
    try:
        c.health()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False
