"""The state store under stress, on SQLite and on PostgreSQL: a server killed (-9) in the middle of
100 concurrent submits loses none it acknowledged; PostgreSQL restarted (immediate stop) under a
running server and a running job: the server reconnects and nothing is lost."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import bearer

from conftest import group_members, kill_group
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobSpec, JobState

pytestmark = pytest.mark.timeout(300)
CLI = [sys.executable, "-m", "torchrelay.client.cli.main"]
JOBS = Path(__file__).resolve().parents[1] / "jobs" / "plain"


class Server:
    """``relay server`` on ``db_url`` and a port the OS chose at the first start, kept across restarts."""

    def __init__(self, home: Path, db_url: str, *args: str):
        self.home, self.db_url, self.args, self.port, self.proc = home, db_url, args, 0, None

    def start(self) -> str:
        from torchrelay.home import read_json, server_file

        server_file(self.home).unlink(missing_ok=True)
        log = open(self.home / "server.log", "ab")
        self.proc = subprocess.Popen([*CLI, "server", "--port", str(self.port), "--heartbeat-timeout", "20", *self.args],
                                     env={**os.environ, "RELAY_HOME": str(self.home), "RELAY_DB": self.db_url},
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        while not (info := read_json(server_file(self.home))):
            assert self.proc.poll() is None, (self.home / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.port = int(info["address"].rsplit(":", 1)[1])
        _login(self.home, info["address"])
        return info["address"]

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid)
            self.proc.wait(timeout=15)
            assert group_members(self.proc.pid) == []


_last_admin: list[str] = []


def _login(home: Path, address: str) -> None:
    """Store the admin token for ``address``, as `relay login` would: the one the server wrote in
    ``home`` at the store's first start, else (a second server of one store) the last one written."""
    from torchrelay.client.credentials import store_token
    from torchrelay.home import admin_token_file

    if admin_token_file(home).exists():
        _last_admin[:] = [admin_token_file(home).read_text().strip()]
    if _last_admin:
        store_token(address, _last_admin[0])


@pytest.fixture
def server(relay_home, db_url):
    made = Server(relay_home, db_url)
    try:
        yield made
    finally:
        made.stop()


def test_kill_9_during_100_concurrent_submits_loses_no_acknowledged_submit(server):
    address = server.start()
    acknowledged: dict[str, str] = {}
    lock = threading.Lock()
    go = threading.Barrier(100)

    def submit(i: int) -> None:
        body = {"spec": {"name": f"s{i}", "entrypoint": "python -c pass"}}
        with httpx.Client(base_url=f"{address}/api/v1", timeout=30, headers=bearer(address)) as http:
            go.wait()
            try:
                reply = http.post("/jobs", json=body)
            except httpx.HTTPError:
                return  # not acknowledged: the server died first
            if reply.status_code == 201:
                with lock:
                    acknowledged[reply.json()["id"]] = f"s{i}"

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acknowledged) < 20 and time.monotonic() < deadline:
        time.sleep(0.001)
    server.kill()  # mid-stream: some submits are acknowledged, others in flight or not sent
    for t in threads:
        t.join(timeout=60)
    assert acknowledged, "no submit was acknowledged before the kill: the check would be empty"
    server.start()
    with RelayClient(address) as c:
        stored = {j.id: j.name for j in c.jobs(limit=1000)}
    assert {job_id: stored.get(job_id) for job_id in acknowledged} == acknowledged


@pytest.mark.slow
def test_postgresql_restarted_under_a_running_server_loses_nothing(relay_home, postgres, server):
    if not server.db_url.startswith("postgresql"):
        pytest.skip("restarts PostgreSQL: the SQLite store has no server to restart")
    address = server.start()
    agent_log = open(relay_home / "agent.log", "ab")
    agent = subprocess.Popen([*CLI, "agent", "--address", address, "--name", "a0", "--cpus", "1",
                              "--work-dir", str(relay_home / "a0")], env={**os.environ, "RELAY_HOME": str(relay_home)},
                             stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with RelayClient(address) as c:
            c.wait_for_nodes(1, timeout=60)
            job = c.submit(JobSpec.parse({"name": "counted", "entrypoint": "python counter.py 100"}), base_dir=JOBS)
            deadline = time.monotonic() + 120
            while len(list(c.iter_logs(job.id))) < 10:
                assert time.monotonic() < deadline, "the job did not start"
                time.sleep(0.1)
            postgres.restart()  # immediate: every connection of the server breaks mid-use
            final = c.wait(job.id, timeout=180)
            assert final.state == JobState.SUCCEEDED, (final.failure, [e.message for e in final.events])
            assert [line.text for line in c.iter_logs(job.id)] == [f"line {i}" for i in range(100)]
            assert sorted(p.step for p in c.iter_metrics(job.id)) == list(range(100))
            after = c.submit(JobSpec.parse({"name": "after", "entrypoint": "python counter.py 2"}), base_dir=JOBS)
            assert c.wait(after.id, timeout=120).state == JobState.SUCCEEDED
    finally:
        kill_group(agent.pid)
        agent.wait(timeout=15)
        agent_log.close()
