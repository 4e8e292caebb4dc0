"""The agent's loop with fake launches and a fake server: no processes, no HTTP (the pattern of
torch.distributed.elastic's ``TestAgent``). Reconcile, stop, delivery order, re-registration,
shutdown and what an earlier agent left, each against what the server saw."""
from __future__ import annotations

import threading
import time

import pytest

from torchrelay import wire
from torchrelay.agent.daemon import Agent
from torchrelay.agent.outbox import EntryKind
from torchrelay.agent.server_link import NodeUnknown, ServerUnreachable

pytestmark = pytest.mark.timeout(60)


def assignment(launch_id="L1", desired="run", **overrides) -> wire.LaunchAssignment:
    data = dict(launch_id=launch_id, job_id="job-1", attempt=0, desired=desired, node_rank=0, nnodes=1,
                nproc_per_node=1, world_size=1, rank_offset=0, entrypoint=["python", "x.py"], bundle=None,
                store_url="/store", job_store_prefix="jobs/job-1", stop_grace_s=7.0)
    data.update(overrides)
    return wire.LaunchAssignment(**data)


def wait_until(predicate, timeout=20.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class FakeServer:
    """The server as the agent sees it (``ServerLink``), in memory. A long poll waits until the
    desired launches change (``set_launches``) or its ``wait_s`` passed."""

    def __init__(self):
        self.changed = threading.Condition()
        self.version = 0
        self.launches: list[wire.LaunchAssignment] = []
        self.registrations: list[wire.NodeRegistration] = []
        self.beats: list[wire.Heartbeat] = []
        self.events: list[tuple] = []  # ("status", launch, state) and ("logs"/"metrics", launch, n), in arrival order
        self.unreachable = False  # posts of records fail
        self.forget_node = False  # the next heartbeat answers 404
        self.closed = False

    def set_launches(self, *launches: wire.LaunchAssignment) -> None:
        with self.changed:
            self.launches = list(launches)
            self.version += 1
            self.changed.notify_all()

    def register(self, registration):
        with self.changed:
            self.registrations.append(registration)
        return wire.RegisterReply(node_id=registration.node_id or "node-1", heartbeat_timeout_s=30.0)

    def heartbeat(self, node_id, beat):
        with self.changed:
            if self.forget_node:
                self.forget_node = False
                raise NodeUnknown(404, "unknown node")
            self.beats.append(beat)
            for report in beat.statuses:
                self.events.append(("status", report.launch_id, report.status.state))
            if beat.wait_s and beat.known_version == self.version:
                self.changed.wait_for(lambda: self.version != beat.known_version or self.closed, beat.wait_s)
            if self.closed:
                raise ServerUnreachable("closed")
            return wire.HeartbeatReply(version=self.version, node_state="READY", launches=list(self.launches),
                                       statuses_taken=len(beat.statuses))

    def post_records(self, kind, job_id, launch_id, records):
        with self.changed:
            if self.unreachable:
                raise ServerUnreachable("the test says so")
            self.events.append((kind.value, launch_id, len(records)))

    def fetch_bundle(self, digest):
        raise AssertionError("no bundles in these tests")

    def close(self):
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def statuses(self, launch_id):
        with self.changed:
            return [state for kind, lid, state in self.events if kind == "status" and lid == launch_id]

    def statuses_of(self, launch_id):
        with self.changed:
            return [report.status for beat in self.beats for report in beat.statuses if report.launch_id == launch_id]


class FakeLaunch:
    """A launch that runs until the test ends it (``finish``) or the agent stops it."""

    def __init__(self, assignment, on_start=None, **where):
        self.assignment = assignment
        self.where = where
        self.on_start = on_start
        self.started_with: tuple | None = None
        self.stopped_with: float | None = None
        self.logs: list[wire.LogRecord] = []
        self._final: wire.LaunchStatus | None = None
        self._ended = threading.Event()

    def start(self, master_addr, master_port):
        if self.on_start is not None:
            self.on_start(self, master_addr, master_port)
        self.started_with = (master_addr, master_port)

    def finish(self, succeeded=True, lines=()):
        self.logs += [wire.LogRecord(rank=0, seq=i, text=text) for i, text in enumerate(lines)]
        self._final = wire.LaunchStatus(state="exited", succeeded=succeeded, message="fake")
        self._ended.set()

    def wait(self, timeout=None):
        return self._final if self._ended.wait(timeout) else None

    def stop(self, grace_s=10.0):
        if self._final is None:
            self.stopped_with = grace_s
            self._final = wire.LaunchStatus(state="exited", succeeded=False, stopped=True, message="stopped")
            self._ended.set()
        return self._final

    def take_logs(self):
        logs, self.logs = self.logs, []
        return logs

    def take_metrics(self):
        return []


class Launches:
    """The launch factory the agent is given: remembers what it made."""

    def __init__(self):
        self.made: dict[str, FakeLaunch] = {}
        self.on_start = None

    def __call__(self, assignment, **where):
        launch = self.made[assignment.launch_id] = FakeLaunch(assignment, self.on_start, **where)
        return launch

    def get(self, launch_id, timeout=20.0) -> FakeLaunch:
        wait_until(lambda: launch_id in self.made and self.made[launch_id].started_with, timeout,
                   f"launch {launch_id} to start")
        return self.made[launch_id]


@pytest.fixture
def node(tmp_path):
    server, launches, swept = FakeServer(), Launches(), []
    agent = Agent("http://fake:1", name="n", cpus=1, gpus=0, memory=1, work_dir=tmp_path / "agent",
                  heartbeat_wait_s=0.5, ship_interval_s=0.05, zygote=False, launch_factory=launches, server=server,
                  sweep=lambda launch_id, launch_dir: swept.append(launch_id) or 0)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    (tmp_path / "agent" / "launches" / "left-by-an-earlier-agent").mkdir(parents=True)
    thread.start()
    yield server, launches, agent, swept
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the agent did not close"


def test_a_launch_runs_and_its_exit_follows_its_lines(node):
    server, launches, agent, _ = node
    server.set_launches(assignment())
    launch = launches.get("L1")
    assert launch.started_with[0] == "127.0.0.1" and launch.where["run_dir"].name == "L1"
    wait_until(lambda: "running" in server.statuses("L1"), what="running")
    launch.finish(lines=["one", "two"])
    wait_until(lambda: "exited" in server.statuses("L1"), what="the exit")
    assert server.statuses("L1") == ["running", "exited"]  # the preparing said nothing the running does not
    kinds = [(kind, n) for kind, lid, n in server.events if lid == "L1" and kind != "status"]
    assert kinds == [("logs", 2)]
    assert server.events.index(("logs", "L1", 2)) < server.events.index(("status", "L1", "exited"))
    assert agent.launches() == {"L1": "exited"}
    server.set_launches()  # the server is done with it: the agent lets go of it
    wait_until(lambda: agent.launches() == {}, what="the launch to be forgotten")
    server.set_launches(assignment())  # ...and never starts it again
    time.sleep(0.2)
    assert list(launches.made) == ["L1"] and agent.launches() == {}


def test_a_stop_ends_the_launch_with_its_grace(node):
    server, launches, agent, _ = node
    server.set_launches(assignment())
    launch = launches.get("L1")
    server.set_launches(assignment(desired="stop", stop_grace_s=0.0))  # cancel --no-checkpoint
    wait_until(lambda: "exited" in server.statuses("L1"), what="the exit")
    assert launch.stopped_with == 0.0
    (final,) = [s for s in server.statuses_of("L1") if s.state == "exited"]
    assert final.stopped is True


def test_a_launch_the_server_no_longer_lists_is_stopped(node):
    server, launches, _, _ = node
    server.set_launches(assignment())
    launch = launches.get("L1")
    server.set_launches()
    wait_until(lambda: "exited" in server.statuses("L1"), what="the exit")
    assert launch.stopped_with == 7.0  # the assignment's grace


def test_a_stop_of_a_launch_it_never_had_is_reported_once(node):
    server, launches, _, _ = node
    server.set_launches(assignment("ghost", desired="stop"))
    wait_until(lambda: "exited" in server.statuses("ghost"), what="the report")
    (report,) = server.statuses_of("ghost")
    assert (report.stopped, report.message) == (True, "never started")
    server.set_launches(assignment("ghost", desired="stop"))
    time.sleep(0.3)
    assert server.statuses("ghost") == ["exited"] and launches.made == {}


def test_an_exit_waits_for_its_lines_while_the_server_is_away(node):
    server, launches, _, _ = node
    server.set_launches(assignment())
    launch = launches.get("L1")
    wait_until(lambda: "running" in server.statuses("L1"), what="running")
    server.unreachable = True
    launch.finish(lines=["last words"])
    time.sleep(0.5)  # several courier cycles and heartbeats
    assert "exited" not in server.statuses("L1")
    server.unreachable = False
    wait_until(lambda: "exited" in server.statuses("L1"), what="the exit")
    assert server.events.index(("logs", "L1", 1)) < server.events.index(("status", "L1", "exited"))


def test_node_zero_of_a_larger_world_delivers_its_port_before_it_starts(node):
    server, launches, _, _ = node
    seen_before_start = []

    def start_once_the_port_is_out(launch, master_addr, master_port):
        # torchrun would wait for its peers here: they need the port first
        wait_until(lambda: any(s.master_port == master_port for s in server.statuses_of("L1")), what="the port")
        seen_before_start.append(master_port)

    launches.on_start = start_once_the_port_is_out
    server.set_launches(assignment(nnodes=2, world_size=2))
    launch = launches.get("L1")
    assert seen_before_start == [launch.started_with[1]]
    wait_until(lambda: "running" in server.statuses("L1"), what="running")
    assert server.statuses_of("L1")[-1].master_port == launch.started_with[1]


def test_another_node_waits_for_node_zeros_port(node):
    server, launches, _, _ = node
    peer = dict(nnodes=2, world_size=2, node_rank=1, rank_offset=1)
    server.set_launches(assignment(**peer))
    time.sleep(0.3)
    assert "L1" not in launches.made  # nothing to connect to yet
    server.set_launches(assignment(master_addr="10.0.0.5", master_port=29500, **peer))
    assert launches.get("L1").started_with == ("10.0.0.5", 29500)


def test_a_server_that_forgot_the_node_gets_it_registered_again_under_its_id(node):
    server, _, agent, _ = node
    wait_until(lambda: server.beats, what="a heartbeat")
    server.forget_node = True
    server.set_launches()  # wake the long poll
    wait_until(lambda: len(server.registrations) == 2, what="the second registration")
    assert server.registrations[1].node_id == "node-1" == agent.node_id


def test_close_stops_what_runs_and_delivers_its_end(tmp_path):
    server, launches = FakeServer(), Launches()
    agent = Agent("http://fake:1", name="n", cpus=1, gpus=0, memory=1, work_dir=tmp_path, heartbeat_wait_s=0.5,
                  ship_interval_s=0.05, zygote=False, launch_factory=launches, server=server, sweep=lambda *_: 0)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    server.set_launches(assignment("A"), assignment("B"))
    a, b = launches.get("A"), launches.get("B")
    b.finish()
    stop.set()
    thread.join(timeout=30)
    assert a.stopped_with == 7.0 and b.stopped_with is None
    assert server.statuses("A")[-1] == "exited" and server.statuses("B")[-1] == "exited"
    agent.close()  # idempotent


def test_start_sweeps_what_an_earlier_agent_left(node):
    server, _, _, swept = node
    wait_until(lambda: server.registrations, what="the registration")  # which comes after the sweep
    assert swept == ["left-by-an-earlier-agent"]


def test_batches_of_one_launch_and_kind_go_together_and_in_order(tmp_path):
    server = FakeServer()
    agent = Agent("http://fake:1", name="n", cpus=1, gpus=0, memory=1, work_dir=tmp_path, zygote=False,
                  server=server, launch_factory=Launches())
    records = [wire.LogRecord(rank=0, seq=i, text="x") for i in range(2500)]
    agent.outbox.put_records("L", "job-1", records[:1500], [])
    agent.outbox.put_records("L", "job-1", records[1500:], [])
    assert agent._deliver_batches() is True
    assert [e for e in server.events] == [(EntryKind.LOGS.value, "L", 2000), (EntryKind.LOGS.value, "L", 500)]
    assert len(agent.outbox) == 0
    agent.close()



def test_a_batch_over_the_servers_size_limit_goes_again_in_halves_and_loses_nothing(tmp_path):
    from torchrelay.agent.server_link import ServerRefused

    class Limited(FakeServer):
        def post_records(self, kind, job_id, launch_id, records):
            if len(records) > 300:  # as a server with a small limits.log_batch answers
                raise ServerRefused(413, "the log batch is over the server's limit")
            with self.changed:
                self.events.append((kind.value, launch_id, [r.seq for r in records]))

    server = Limited()
    agent = Agent("http://fake:1", name="n", cpus=1, gpus=0, memory=1, work_dir=tmp_path, zygote=False,
                  server=server, launch_factory=Launches())
    agent.outbox.put_records("L", "job-1", [wire.LogRecord(rank=0, seq=i, text="x") for i in range(1000)], [])
    assert agent._deliver_batches() is True
    assert all(len(seqs) <= 300 for _kind, _launch, seqs in server.events)
    assert [seq for _kind, _launch, seqs in server.events for seq in seqs] == list(range(1000))
    assert len(agent.outbox) == 0
    agent.close()
