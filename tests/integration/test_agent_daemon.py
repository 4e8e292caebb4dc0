"""The agent daemon against a real server (uvicorn on a port the OS picks) with real workers:
a 2-worker gloo job to SUCCEEDED with its logs and metrics shipped, a cancel mid-run that
leaves no process, buffering while the server is away, and clean-up after an agent that died."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest
import uvicorn

from torchrelay.agent.daemon import Agent
from torchrelay.agent.processes import find_launch_processes
from torchrelay.client.sdk import RelayClient
from torchrelay.client.credentials import store_token, token_for
from torchrelay.home import admin_token_file
from torchrelay.server.app import create_app
from torchrelay.server.main import announce_first_admin
from torchrelay.server.service import ClusterService
from torchrelay.spec import JobSpec, JobState

pytestmark = pytest.mark.timeout(240)

SCRIPT = """
import json, os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank}/{world} sum={t.item():g}", flush=True)
with open(os.path.join(os.environ["RELAY_METRICS_DIR"], f"rank-{rank}.jsonl"), "a") as fh:
    fh.write(json.dumps({"step": 1, "time": time.time(), "values": {"sum": t.item()}}) + "\\n")
if "hang" in sys.argv:
    print(f"rank {rank} ready", flush=True)
    time.sleep(600)
dist.destroy_process_group()
"""


class ServerThread:
    """A real torchrelay server (uvicorn) in a thread of this process, on ``port`` (0: the OS
    picks), over the database in ``home`` (so a second one on the same port is a restart)."""

    def __init__(self, home: Path, port: int = 0, heartbeat_timeout_s: float = 10.0, wrap=None):
        self.service = ClusterService(f"sqlite:///{home / 'state.db'}", str(home / "store"), tick_s=0.2,
                                      heartbeat_timeout_s=heartbeat_timeout_s)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.sock.bind(("127.0.0.1", port))
                break
            except OSError:  # a restart on the same port: wait until the old one let it go
                assert time.monotonic() < deadline, f"port {port} never came free"
                time.sleep(0.1)
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.address = f"http://127.0.0.1:{self.port}"
        app = create_app(self.service)
        # what `relay server` does at a store's first start, and what `relay login` does with it
        announce_first_admin(app.state.guard.credentials, home)
        store_token(self.address, admin_token_file(home).read_text().strip())
        self.app = wrap(app) if wrap is not None else app  # wrap: an ASGI app around the server's
        config = uvicorn.Config(self.app, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


class AgentThread:
    def __init__(self, address: str, work_dir: Path, name: str = "node-a"):
        self.agent = Agent(address, name=name, cpus=2, gpus=0, memory=2**32, work_dir=work_dir,
                           heartbeat_wait_s=5.0, ship_interval_s=0.2, stop_grace_s=3.0,
                           enroll_token=token_for(address))
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.agent.run, args=(self.stop_event,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "agent did not stop"


@pytest.fixture
def job_dir(tmp_path):
    code = tmp_path / "job"
    code.mkdir()
    (code / "job.py").write_text(textwrap.dedent(SCRIPT))
    return code


@pytest.fixture
def cluster(tmp_path):
    server = ServerThread(tmp_path)
    agent = AgentThread(server.address, tmp_path / "agent")
    try:
        yield server, agent
    finally:
        agent.stop()
        server.stop()
    launches = tmp_path / "agent" / "launches"
    for launch_dir in (launches.iterdir() if launches.exists() else ()):
        assert find_launch_processes(launch_dir.name, launch_dir) == [], f"processes of {launch_dir.name} left"


def spec(mode: str = "ok") -> JobSpec:
    return JobSpec.parse({"name": "allreduce", "entrypoint": f"python job.py {mode}", "workers": 2})


def test_job_succeeds_with_logs_and_metrics(cluster, job_dir, tmp_path):
    server, agent = cluster
    with RelayClient(server.address) as client:
        client.wait_for_nodes(1, timeout=30)
        info = client.submit(spec(), base_dir=job_dir)
        final = client.wait(info.id, timeout=180, poll_s=2)
        assert final.state == JobState.SUCCEEDED, final
        texts = {line.text for line in client.logs(info.id).lines}
        assert {"rank 0/2 sum=3", "rank 1/2 sum=3"} <= texts
        points = client.metrics(info.id).points
        assert sorted((p.rank, p.step, p.values["sum"]) for p in points) == [(0, 1, 3.0), (1, 1, 3.0)]
    assert (tmp_path / "agent" / "bundles" / f"{info.bundle}.tar.gz").exists()  # cached by digest
    assert json.loads((tmp_path / "agent" / "node.json").read_text())["node_id"] == agent.agent.node_id


def launch_processes(launch_id: str, launch_dir: Path) -> list[int]:
    """The launch's live processes: those tagged with it, and the ranks (and store) its warm
    zygote forked, named in ``ranks.json`` (their environment is the zygote's)."""
    pids = find_launch_processes(launch_id, launch_dir)
    try:
        record = json.loads((launch_dir / "ranks.json").read_text())
    except FileNotFoundError:
        return pids
    for pid in [*record["ranks"].values(), record["store"]]:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, TypeError):
            continue
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(") ", 1)[1].split()[0] != "Z":
                pids.append(pid)
    return pids


def test_cancel_mid_run_stops_every_process(cluster, job_dir, tmp_path):
    server, agent = cluster
    with RelayClient(server.address) as client:
        client.wait_for_nodes(1, timeout=30)
        info = client.submit(spec("hang"), base_dir=job_dir)
        deadline = time.monotonic() + 150
        while {line.text for line in client.logs(info.id).lines} < {"rank 0 ready", "rank 1 ready"}:
            assert time.monotonic() < deadline, "workers never got ready"
            assert not client.job(info.id).state.terminal, client.job(info.id)
            time.sleep(0.2)
        (launch_dir,) = (tmp_path / "agent" / "launches").iterdir()
        launch_id = launch_dir.name
        assert len(launch_processes(launch_id, launch_dir)) >= 3  # 2 ranks forked warm and the store
        client.cancel(info.id)
        final = client.wait(info.id, timeout=60, poll_s=2)
        assert final.state == JobState.CANCELLED, final
        assert launch_processes(launch_id, launch_dir) == []
        assert agent.agent.launches().get(launch_id) in (None, "exited")


SOLO = """
import json, os, sys, time
with open(os.path.join(os.environ["RELAY_METRICS_DIR"], "rank-0.jsonl"), "a") as fh:
    fh.write(json.dumps({"step": 1, "time": time.time(), "values": {"x": 1.0}}) + "\\n")
print("solo", os.environ["RANK"], os.environ["WORLD_SIZE"], "TORCHELASTIC_USE_AGENT_STORE=" +
      os.environ["TORCHELASTIC_USE_AGENT_STORE"], flush=True)
if "hang" in sys.argv:
    print("solo ready", flush=True)
    time.sleep(600)
"""


def test_a_world_of_one_runs_without_torchrun(cluster, tmp_path):
    """One worker on one node: forked by the agent's zygote, no torchrun; the job still goes
    through RUNNING to SUCCEEDED with its lines and metrics, and a cancel leaves nothing."""
    server, agent = cluster
    code = tmp_path / "solo"
    code.mkdir()
    (code / "solo.py").write_text(textwrap.dedent(SOLO))
    with RelayClient(server.address) as client:
        client.wait_for_nodes(1, timeout=30)
        info = client.submit(JobSpec.parse({"name": "solo", "entrypoint": "python solo.py", "workers": 1}),
                             base_dir=code)
        final = client.wait(info.id, timeout=60, poll_s=0.5)
        assert final.state == JobState.SUCCEEDED, final
        assert JobState.RUNNING in {event.state for event in final.events}
        assert "solo 0 1 TORCHELASTIC_USE_AGENT_STORE=False" in {line.text for line in client.logs(info.id).lines}
        assert [(p.rank, p.step) for p in client.metrics(info.id).points] == [(0, 1)]
        (launch_dir,) = [p for p in (tmp_path / "agent" / "launches").iterdir()]
        assert "forked by the zygote" in (launch_dir / "launch.log").read_text()
        assert not (launch_dir / "torchrun.log").exists()

        hang = client.submit(JobSpec.parse({"name": "solo", "entrypoint": "python solo.py hang", "workers": 1}),
                             base_dir=code)
        deadline = time.monotonic() + 60
        while "solo ready" not in {line.text for line in client.logs(hang.id).lines}:
            assert time.monotonic() < deadline, "the worker never got ready"
            time.sleep(0.1)
        client.cancel(hang.id)
        final = client.wait(hang.id, timeout=60, poll_s=0.5)
        assert final.state == JobState.CANCELLED, final
    # a forked worker's own environment does not name its launch: find it by its marker's pid
    (marker,) = [p for p in (tmp_path / "agent" / "launches").glob("*/status/rank-0.json")
                 if p.parent.parent != launch_dir]
    with pytest.raises(ProcessLookupError):
        os.killpg(json.loads(marker.read_text())["pid"], 0)
    zygote = agent.agent.zygote
    assert zygote is not None and zygote.pid is not None
    agent.stop()
    assert zygote._proc.poll() is not None  # closing the agent ends its zygote


class RefuseStatusesAside:
    """ASGI app in front of the server that answers 503 to the first ``refuse`` heartbeats that
    carry statuses without long-polling (the ones the agent sends aside while a long poll is in
    flight), counting them, and passes everything else on."""

    def __init__(self, app, refuse: int = 1):
        self.app = app
        self.refuse = refuse
        self.refused = 0

    async def __call__(self, scope, receive, send):
        if not (scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith("/heartbeat")):
            await self.app(scope, receive, send)
            return
        messages, more = [], True
        while more:
            message = await receive()
            messages.append(message)
            more = message.get("more_body", False)
        beat = json.loads(b"".join(m.get("body", b"") for m in messages) or b"{}")
        if self.refused < self.refuse and beat.get("statuses") and not beat.get("wait_s"):
            self.refused += 1
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"refused by the test"})
            return

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def test_a_status_whose_delivery_failed_arrives_with_a_later_heartbeat(tmp_path):
    """Statuses ride in heartbeats; the one sent aside while a long poll was in flight (the exit)
    is refused here, and still reaches the server with a later heartbeat."""
    server = ServerThread(tmp_path, wrap=RefuseStatusesAside)
    agent = AgentThread(server.address, tmp_path / "agent")
    try:
        with RelayClient(server.address) as client:
            client.wait_for_nodes(1, timeout=30)
            info = client.submit(JobSpec.parse({"name": "nap", "workers": 1,
                                                "entrypoint": "python -c 'import time; time.sleep(0.5)'"}),
                                 upload=False)
            final = client.wait(info.id, timeout=60, poll_s=0.2)
            assert final.state == JobState.SUCCEEDED, final
            assert [e.state for e in final.events] == [JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING,
                                                       JobState.SUCCEEDED]
        assert server.app.refused >= 1  # the exit was sent aside (and refused) first
    finally:
        agent.stop()
        server.stop()


@pytest.mark.slow
def test_agent_keeps_what_it_could_not_send(tmp_path, job_dir):
    """The server goes away mid-job and comes back on the same port with the same database:
    the job's lines and final status, produced meanwhile, all arrive."""
    server = ServerThread(tmp_path, heartbeat_timeout_s=300)
    agent = AgentThread(server.address, tmp_path / "agent")
    try:
        with RelayClient(server.address) as client:
            client.wait_for_nodes(1, timeout=30)
            info = client.submit(spec(), base_dir=job_dir)
        deadline = time.monotonic() + 150
        while not agent.agent.launches():
            assert time.monotonic() < deadline, "the agent never got the launch"
            time.sleep(0.05)
        server.stop()
        (launch_id,) = agent.agent.launches()
        while agent.agent.launches().get(launch_id) != "exited":  # the job finishes meanwhile
            assert time.monotonic() < deadline, "the launch never finished"
            time.sleep(0.1)
        server = ServerThread(tmp_path, port=server.port, heartbeat_timeout_s=300)
        with RelayClient(server.address) as client:
            final = client.wait(info.id, timeout=60, poll_s=2)
            assert final.state == JobState.SUCCEEDED, final
            texts = {line.text for line in client.logs(info.id).lines}
            assert {"rank 0/2 sum=3", "rank 1/2 sum=3"} <= texts
    finally:
        agent.stop()
        server.stop()
    assert find_launch_processes(launch_id, tmp_path / "agent" / "launches" / launch_id) == []


def test_start_ends_processes_an_earlier_agent_left(tmp_path):
    launch_id = f"orphan-{os.getpid()}-{time.monotonic_ns()}"
    (tmp_path / "agent" / "launches" / launch_id).mkdir(parents=True)
    (tmp_path / "agent" / "node.json").write_text(json.dumps({"node_id": "node-earlier"}))
    launch_dir = tmp_path / "agent" / "launches" / launch_id
    orphan = subprocess.Popen(["sleep", "600"], env={**os.environ, "RELAY_LAUNCH_ID": launch_id,
                                                      "RELAY_LAUNCH_DIR": str(launch_dir)},
                              start_new_session=True)
    # another cluster's process with the same launch id (ids repeat across clusters): left alone
    stranger = subprocess.Popen(["sleep", "600"], env={**os.environ, "RELAY_LAUNCH_ID": launch_id,
                                                        "RELAY_LAUNCH_DIR": str(tmp_path / "elsewhere")},
                                start_new_session=True)
    server = ServerThread(tmp_path)
    agent = AgentThread(server.address, tmp_path / "agent")
    try:
        assert orphan.wait(timeout=30) == -signal.SIGKILL
        with RelayClient(server.address) as client:
            (node,) = client.wait_for_nodes(1, timeout=30)
        assert node.id == "node-earlier"  # registered again under the saved id
        assert stranger.poll() is None
    finally:
        for proc in (orphan, stranger):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        agent.stop()
        server.stop()
