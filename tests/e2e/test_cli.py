"""The `relay` CLI as a user types it, against an embedded cluster it starts itself."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import group_members

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
PLAIN = REPO / "tests" / "jobs" / "plain"
RELAY = [sys.executable, "-m", "torchrelay.client.cli.main"]


def relay(*args, cwd=None, check=True, timeout=180):
    proc = subprocess.run([*RELAY, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})
    if check and proc.returncode != 0:
        raise AssertionError(f"relay {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def up(relay_home):
    out = relay("up", "--agents", "2", "--detach")
    assert "cluster up" in out.stdout
    info = json.loads((relay_home / "cluster.json").read_text())
    yield info
    relay("down")
    for pid in info["pids"]:
        assert group_members(pid) == []


def test_session(up, relay_home, tmp_path):
    nodes = json.loads(relay("nodes", "-o", "json").stdout)
    assert sorted(n["name"] for n in nodes) == ["agent-0", "agent-1"]

    job_id = relay("submit", str(PLAIN / "job.yaml")).stdout.strip()
    assert job_id.startswith("job-")
    final = json.loads(relay("status", job_id, "-o", "json").stdout)
    assert final["id"] == job_id

    followed = relay("submit", str(PLAIN / "job.yaml"), "--follow", "--set", "name=again")
    assert "SUCCEEDED" in followed.stdout and "sum=3" in followed.stdout

    jobs = json.loads(relay("ls", "-o", "json").stdout)
    assert [j["name"] for j in jobs][:2] == ["again", "allreduce"]
    table = relay("ls").stdout
    assert "again" in table and "SUCCEEDED" in table

    logs = relay("logs", job_id, "--rank", "1").stdout
    assert "[rank 1] rank 1/2 sum=3" in logs and "[rank 0]" not in logs
    assert relay("status", job_id).stdout.count("SUCCEEDED") >= 1

    ran = relay("run", "--workers", "2", "--", "python", "allreduce.py", cwd=PLAIN)
    assert "sum=3" in ran.stdout and "SUCCEEDED" in ran.stdout

    failed = relay("run", "--workers", "2", "--", "python", "allreduce.py", "fail", cwd=PLAIN, check=False)
    assert failed.returncode == 1
    assert "rank 1 exited with code 3" in failed.stdout and "about to fail" in failed.stdout

    dry = relay("submit", str(PLAIN / "job.yaml"), "--dry-run", "-o", "json", "--set", "workers=1")
    assert json.loads(dry.stdout)["workers"] == 1

    every = json.loads(relay("ls", "-o", "json").stdout)
    assert [j["submitted_at"] for j in every] == sorted((j["submitted_at"] for j in every), reverse=True)
    assert "newest first" in relay("ls", "--help").stdout
    newest = json.loads(relay("ls", "--limit", "2", "-o", "json").stdout)
    assert [j["id"] for j in newest] == [j["id"] for j in every[:2]]
    failed_only = json.loads(relay("ls", "--state", "failed", "-o", "json").stdout)
    assert [j["id"] for j in failed_only] == [j["id"] for j in every if j["state"] == "FAILED"] and failed_only
    both = json.loads(relay("ls", "--state", "FAILED,SUCCEEDED", "--limit", "100", "-o", "json").stdout)
    assert len(both) == len(every)
    bad = relay("ls", "--state", "DONE", check=False)
    assert bad.returncode == 1 and "'DONE' is not a job state" in bad.stderr


@pytest.mark.parametrize("args, code, needle", [
    (("status", "job-999"), 1, "job 'job-999' does not exist"),
    (("logs", "nonsense"), 1, "'nonsense' does not exist"),
    (("submit", str(PLAIN / "missing.yaml")), 1, "does not exist"),
])
def test_clear_errors_without_traceback(up, args, code, needle):
    proc = relay(*args, check=False)
    assert proc.returncode == code and needle in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_bad_spec_names_the_key(up, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("entrypoint: python x.py\nworkerz: 2\n")
    proc = relay("submit", str(bad), check=False)
    assert proc.returncode == 1 and "unknown key 'workerz'" in proc.stderr and "Traceback" not in proc.stderr
    huge = tmp_path / "huge.yaml"
    huge.write_text("entrypoint: python x.py\nworkers: 500\n")
    proc = relay("submit", str(huge), check=False)
    assert proc.returncode == 1 and "can never run here" in proc.stderr


def test_no_server_says_how_to_start_one(relay_home):
    proc = relay("ls", check=False)
    assert proc.returncode == 2 and "relay up" in proc.stderr and "Traceback" not in proc.stderr


def test_run_starts_and_stops_its_own_cluster(relay_home):
    proc = relay("run", "--workers", "2", "--", "python", "allreduce.py", cwd=PLAIN)
    assert "starting an embedded cluster" in proc.stderr and "SUCCEEDED" in proc.stdout
    assert not (relay_home / "cluster.json").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("named_by", ["RELAY_ADDRESS", "--port"])
def test_up_listens_where_it_is_told(relay_home, monkeypatch, named_by):
    port = _free_port()
    address = f"http://127.0.0.1:{port}"
    if named_by == "RELAY_ADDRESS":
        monkeypatch.setenv("RELAY_ADDRESS", address)
        out = relay("up", "--agents", "1", "--detach")
    else:
        out = relay("up", "--agents", "1", "--detach", "--port", str(port))
        monkeypatch.setenv("RELAY_ADDRESS", address)  # what `relay up` told the user to export
    info = json.loads((relay_home / "cluster.json").read_text())
    try:
        assert info["address"] == address and address in out.stdout
        assert [n["name"] for n in json.loads(relay("nodes", "-o", "json").stdout)] == ["agent-0"]
        elsewhere = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
        monkeypatch.setenv("RELAY_ADDRESS", elsewhere)
        proc = relay("ls", check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert elsewhere in proc.stderr and address in proc.stderr  # both, and which is which
        assert "RELAY_ADDRESS" in proc.stderr and "RELAY_HOME" in proc.stderr
    finally:
        relay("down")
    for pid in info["pids"]:
        assert group_members(pid) == []


@pytest.fixture
def taken_port():
    """A port something else listens on (127.0.0.1) for the test's length."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


@pytest.mark.parametrize("relay_address, args, needle", [
    ("http://127.0.0.1:{taken}", (), "port {taken} is in use"),
    (None, ("--port", "{taken}"), "port {taken} is in use"),
    ("http://192.0.2.1:{free}", (), "192.0.2.1 is not an address of this machine"),  # TEST-NET-1: never local
    ("http://127.0.0.1:{free}", ("--port", "{taken}"), "disagree"),
    ("https://127.0.0.1:{free}", (), "plain http"),
    ("127.0.0.1:{free}", (), "is not a server URL"),
])
def test_up_refuses_an_address_it_cannot_listen_on(relay_home, monkeypatch, taken_port, relay_address, args,
                                                   needle):
    ports = {"taken": taken_port, "free": _free_port()}
    if relay_address:
        monkeypatch.setenv("RELAY_ADDRESS", relay_address.format(**ports))
    proc = relay("up", "--detach", *(a.format(**ports) for a in args), check=False)
    assert proc.returncode == 1 and needle.format(**ports) in proc.stderr, proc.stderr
    assert ("RELAY_ADDRESS" if relay_address else "--port") in proc.stderr and "Traceback" not in proc.stderr
    assert not (relay_home / "cluster.json").exists() and not (relay_home / "server.json").exists()
