"""Events out: a real server process with ``--events`` and real brokers.

RabbitMQ: Debian's rabbitmq-server as a private node (tests/services/rabbitmq.py), stopped and
killed while events flow; a real job's checkpoint commit reaching it. Kafka: librdkafka's mock
cluster (the confluent-kafka wheel's ``test.mock.num.brokers``, or its C API through ctypes where
a test takes the broker down: ``MockKafka``), which speaks the Kafka protocol to the real client;
a real broker when ``RELAY_TEST_KAFKA`` names one (HOST:PORT).
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import _login_as_admin, bearer, group_members, kill_group
from torchrelay.client.sdk import RelayClient
from torchrelay.server.events.model import Event

pytestmark = pytest.mark.timeout(300)
DASH = Path(__file__).resolve().parents[1] / "jobs" / "dash"  # a small real training job


def start_server(home: Path, *events: str, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    from torchrelay.home import read_json, server_file

    home.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torchrelay.client.cli.main", "server", "--port", "0", "--log-level", "warning"]
    for url in events:
        argv += ["--events", url]
    argv += list(extra)
    log = open(home / "server.log", "ab")
    proc = subprocess.Popen(argv, env={**os.environ, "RELAY_HOME": str(home), "PYTHONUNBUFFERED": "1"},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 60
    while True:
        info = read_json(server_file(home))
        if info and info.get("pid") == proc.pid:
            _login_as_admin(home, info["address"])
            return proc, info["address"]
        assert proc.poll() is None, (home / "server.log").read_text()
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)


def stop_server(proc: subprocess.Popen) -> None:
    kill_group(proc.pid)
    proc.wait(timeout=10)
    assert group_members(proc.pid) == []


def churn(client: RelayClient, jobs: int) -> list[str]:
    """Submit and cancel ``jobs`` jobs (no agent: each queues, then is cancelled): events."""
    ids = []
    for _ in range(jobs):
        info = client.submit({"name": "ev", "entrypoint": "python -c pass"}, upload=False)
        client.cancel(info.id)
        ids.append(info.id)
    return ids


def expected(client: RelayClient, ids: list[str]) -> list[tuple[str, str, str]]:
    return sorted((job, e.state.value, e.message) for job in ids for e in client.job(job).events)


def check_in_order(events: list[Event], ids: list[str], client: RelayClient) -> None:
    """No event lost, none out of order: seqs strictly increase once duplicates are dropped, and
    they are exactly the server's events of these jobs."""
    seen: dict[int, Event] = {}
    order = []
    for event in events:
        if event.seq in seen:
            assert seen[event.seq] == event  # a duplicate is the same event again
            continue
        seen[event.seq] = event
        order.append(event.seq)
    assert order == sorted(order), order
    got = sorted((e.job_id, e.state, e.message) for e in seen.values() if e.job_id in ids)
    assert got == expected(client, ids)


# ---------------------------------------------------------------- RabbitMQ


class AmqpConsumer:
    """A durable queue bound to the events exchange before the server publishes anything."""

    def __init__(self, url: str, exchange: str = "relay.events", queue: str | None = None, binding: str = "job.#"):
        import pika

        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.url = url
        self.exchange = exchange
        self.binding = binding
        self.queue = queue or f"test-{secrets.token_hex(4)}"
        self._declare()
        self.events: list[Event] = []

    def _declare(self) -> None:
        channel = self.connection.channel()
        channel.exchange_declare(self.exchange, exchange_type="topic", durable=True)
        channel.queue_declare(self.queue, durable=True)
        channel.queue_bind(self.queue, self.exchange, routing_key=self.binding)
        self.channel = channel

    def collect(self, count: int, timeout: float = 60) -> list[Event]:
        """Every event until ``count`` distinct seqs arrived (raises after ``timeout`` s)."""
        import pika

        deadline = time.monotonic() + timeout
        while len({e.seq for e in self.events}) < count:
            assert time.monotonic() < deadline, f"{len(self.events)} of {count} events arrived"
            try:
                method, props, body = self.channel.basic_get(self.queue, auto_ack=True)
            except pika.exceptions.AMQPError:  # the broker restarted under us: reconnect
                time.sleep(0.5)
                self.connection = pika.BlockingConnection(pika.URLParameters(self.url))
                self._declare()
                continue
            if method is None:
                time.sleep(0.05)
                continue
            event = Event.from_body(body)
            assert (method.routing_key, props.delivery_mode, props.headers["seq"], props.headers["kind"]) == \
                (event.routing_key(), 2, event.seq, event.kind)
            self.events.append(event)
        return self.events

    def close(self) -> None:
        try:
            self.connection.close()
        except Exception:  # noqa: BLE001 - the broker may be down
            pass


def amqp_outages(rabbitmq, home: Path, outages: list) -> None:
    consumer = AmqpConsumer(rabbitmq.url)
    proc, address = start_server(home, rabbitmq.url)
    try:
        with RelayClient(address) as client:
            ids = churn(client, 5)
            consumer.collect(len(expected(client, ids)))
            for outage in outages:
                consumer.close()
                outage()
                ids += churn(client, 5)  # submits and cancels go on while the broker is down
                rabbitmq.start()
                seen = consumer.events
                consumer = AmqpConsumer(rabbitmq.url, queue=consumer.queue)  # the durable queue kept its messages
                consumer.events = seen
                consumer.collect(len(expected(client, ids)))
            check_in_order(consumer.events, ids, client)
    finally:
        consumer.close()
        stop_server(proc)


def test_amqp_events_survive_a_broker_kill_in_order(rabbitmq, tmp_path):
    amqp_outages(rabbitmq, tmp_path / "home", [rabbitmq.kill])


@pytest.mark.slow
def test_amqp_events_survive_a_broker_restart_then_a_kill_in_order(rabbitmq, tmp_path):
    amqp_outages(rabbitmq, tmp_path / "home", [rabbitmq.stop, rabbitmq.kill])


def test_a_committed_checkpoint_is_a_job_event_and_reaches_rabbitmq(rabbitmq, cluster_factory):
    """A real job (one agent, one worker, tests/jobs/dash) commits the checkpoint of step 2; its
    rank 0 posts the commit with its worker token, the server records a job event (what `relay
    status` lists) and its relay publishes it as ``job.<id>.checkpoint``: step, attempt, where."""
    consumer = AmqpConsumer(rabbitmq.url, binding="job.*.checkpoint")
    try:
        cluster = cluster_factory(1, server_args=["--events", rabbitmq.url])
        with RelayClient(cluster.address) as client:
            info = client.submit({"name": "ckpt", "entrypoint": "python train.py 4 0"}, base_dir=DASH)
            final = client.wait(info.id, timeout=120)
            assert final.state.value == "SUCCEEDED", final
            event = consumer.collect(1)[0]
            assert (event.kind, event.job_id, event.step, event.attempt) == ("checkpoint", info.id, 2, 1)
            assert event.url.endswith(f"{info.id}/checkpoints/step-0000000002"), event.url
            files = [f["path"] for f in client._get(f"/jobs/{info.id}/checkpoints")]
            assert "step-0000000002/MANIFEST.json" in files  # committed, where the event says
            assert [e.message for e in final.events if e.message.startswith("checkpoint of step")] == [event.message]
        from typer.testing import CliRunner

        from torchrelay.client.cli.main import app

        shown = CliRunner().invoke(app, ["status", info.id], env={"RELAY_ADDRESS": cluster.address, "COLUMNS": "500"})
        assert shown.exit_code == 0 and event.message in shown.output, shown.output
    finally:
        consumer.close()


# ---------------------------------------------------------------- Kafka


@pytest.fixture
def kafka_bootstrap():
    """HOST:PORT of a Kafka broker: ``RELAY_TEST_KAFKA``'s, else librdkafka's mock cluster held
    by this process for the test."""
    confluent_kafka = pytest.importorskip("confluent_kafka", reason="confluent-kafka is in the channels extra")
    if os.environ.get("RELAY_TEST_KAFKA"):
        yield os.environ["RELAY_TEST_KAFKA"]
        return
    holder = confluent_kafka.Producer({"test.mock.num.brokers": 1})
    brokers = holder.list_topics(timeout=10).brokers
    yield next(iter(brokers.values())).host + f":{next(iter(brokers.values())).port}"
    holder.flush(1)


class MockKafka:
    """librdkafka's mock cluster made through its C API (ctypes on the confluent-kafka wheel's own
    librdkafka), one broker (id 1). Unlike ``test.mock.num.brokers`` it lets a test take the
    broker down and up again *on the same port* (``rd_kafka_mock_broker_set_down`` / ``_set_up``,
    which confluent-kafka does not expose): down closes its listener and drops every connection,
    so clients get connection refused; up listens on that port again. A server's sink keeps its
    URL across the outage, as it would with a real broker that restarts."""

    def __init__(self) -> None:
        import ctypes

        import confluent_kafka

        found = sorted(Path(confluent_kafka.__file__).parent.parent.glob("confluent_kafka.libs/librdkafka*.so*"))
        if not found:
            pytest.skip("the confluent-kafka wheel's own librdkafka (confluent_kafka.libs) is not there")
        lib = self.lib = ctypes.CDLL(str(found[0]))
        lib.rd_kafka_conf_new.restype = ctypes.c_void_p
        lib.rd_kafka_new.restype = ctypes.c_void_p
        lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
        lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
        lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
        for name in ("rd_kafka_mock_broker_set_down", "rd_kafka_mock_broker_set_up"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.rd_kafka_mock_cluster_destroy.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
        errors = ctypes.create_string_buffer(512)
        self.handle = lib.rd_kafka_new(0, lib.rd_kafka_conf_new(), errors, 512)  # 0: a producer; holds the cluster
        assert self.handle, errors.value
        self.cluster = lib.rd_kafka_mock_cluster_new(self.handle, 1)
        assert self.cluster
        self.bootstrap = lib.rd_kafka_mock_cluster_bootstraps(self.cluster).decode()

    def down(self) -> None:
        assert self.lib.rd_kafka_mock_broker_set_down(self.cluster, 1) == 0

    def up(self) -> None:
        assert self.lib.rd_kafka_mock_broker_set_up(self.cluster, 1) == 0

    def close(self) -> None:
        self.lib.rd_kafka_mock_cluster_destroy(self.cluster)
        self.lib.rd_kafka_destroy(self.handle)


class KafkaEvents:
    """Every event of ``topic`` from its start: all its partitions assigned (no consumer group, so
    nothing to rejoin after an outage), each message's key and seq header checked."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Consumer

        self.topic = topic
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": topic, "enable.auto.commit": False})
        self.events: list[Event] = []
        self.assigned = False

    def _assign(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        topic = self.consumer.list_topics(self.topic, timeout=5).topics.get(self.topic)
        if topic is not None and topic.error is None and topic.partitions:
            self.consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in topic.partitions])
            self.assigned = True

    def collect(self, count: int, timeout: float = 60, messages: int = 0) -> list[Event]:
        """Every message until ``count`` distinct seqs, and ``messages`` messages in all, arrived
        (raises after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while len({e.seq for e in self.events}) < count or len(self.events) < messages:
            assert time.monotonic() < deadline, f"{len({e.seq for e in self.events})} of {count} events arrived"
            if not self.assigned:
                self._assign()
                continue
            msg = self.consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            event = Event.from_body(msg.value())
            assert msg.key() == event.job_id.encode() and dict(msg.headers())["seq"] == str(event.seq).encode()
            self.events.append(event)
        return self.events

    def close(self) -> None:
        self.consumer.close()


def wait_for_log(home: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in (home / "server.log").read_text():
        assert time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
        time.sleep(0.1)


def test_kafka_events_survive_a_broker_outage_and_a_lost_confirm_in_order(tmp_path):
    """Against the mock cluster, its broker taken down and brought back on the same port
    (``MockKafka``): jobs submitted and cancelled while it is down are published once it is back,
    after the relay gave its batch up (the store kept them). Then a lost confirm: the sink's
    cursor is rewound by 4 while the server is stopped, so the restarted server sends the last
    4 events again; they carry the seqs already seen, and once duplicates are dropped every
    event arrived, each job's in order."""
    pytest.importorskip("confluent_kafka", reason="confluent-kafka is in the channels extra")
    import sqlite3

    mock = MockKafka()
    home, topic = tmp_path / "home", f"relay-events-{secrets.token_hex(3)}"
    url = f"kafka://{mock.bootstrap}/{topic}"
    proc, address = start_server(home, url)
    consumer = KafkaEvents(mock.bootstrap, topic)
    try:
        with RelayClient(address) as client:
            ids = churn(client, 3)
            consumer.collect(len(expected(client, ids)))
            mock.down()
            ids += churn(client, 3)  # the control plane goes on while the broker is down
            wait_for_log(home, "keeping them and retrying")  # the relay gave its batch up: the store keeps them
            mock.up()
            consumer.collect(len(expected(client, ids)))
        stop_server(proc)
        seen = {e.seq: e for e in consumer.events}
        with sqlite3.connect(home / "state.db") as db:  # the broker's last 4 confirms "lost"
            assert db.execute("UPDATE event_cursors SET seq = seq - 4 WHERE name LIKE '%#state'").rowcount == 1
        proc, address = start_server(home, url)
        with RelayClient(address) as client:
            ids += churn(client, 1)
            want = expected(client, ids)
            before = len(consumer.events)
            consumer.collect(len(want), messages=before + 4 + len(want) - len(seen))  # 4 again, then the new ones
        again = [e for e in consumer.events[before:] if e.seq in seen]
        assert len(again) >= 4 and all(seen[e.seq] == e for e in again), again  # a duplicate is the same event
        first: dict[int, Event] = {}
        for e in consumer.events:  # dropping duplicates: each seq where it first came
            first.setdefault(e.seq, e)
        for job in ids:
            seqs = [seq for seq, e in first.items() if e.job_id == job]
            assert seqs == sorted(seqs), (job, seqs)  # none out of order
        assert sorted((e.job_id, e.state, e.message) for e in first.values()) == want  # none lost
    finally:
        consumer.close()
        stop_server(proc)
        mock.close()


def test_kafka_events_are_keyed_by_job_in_order(kafka_bootstrap, tmp_path):
    from confluent_kafka import Consumer

    topic = f"relay-events-{secrets.token_hex(3)}"
    proc, address = start_server(tmp_path / "home", f"kafka://{kafka_bootstrap}/{topic}")
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topic, "auto.offset.reset": "earliest"})
    try:
        with RelayClient(address) as client:
            ids = churn(client, 6)
            want = len(expected(client, ids))
            consumer.subscribe([topic])
            events, deadline = [], time.monotonic() + 60
            while len({e.seq for e in events}) < want:
                assert time.monotonic() < deadline, f"{len(events)} of {want} events arrived"
                msg = consumer.poll(0.5)
                if msg is None or msg.error():
                    continue
                event = Event.from_body(msg.value())
                assert msg.key() == event.job_id.encode() and dict(msg.headers())["seq"] == str(event.seq).encode()
                events.append(event)
            by_job: dict[str, list[int]] = {}
            for e in events:  # each seq where it first came (a resend may repeat it later)
                if e.seq not in by_job.get(e.job_id, []):
                    by_job.setdefault(e.job_id, []).append(e.seq)
            assert all(seqs == sorted(seqs) for seqs in by_job.values()), by_job  # a job's events in order
            assert sorted((e.job_id, e.state, e.message) for e in {e.seq: e for e in events}.values()) == \
                expected(client, ids)
    finally:
        consumer.close()
        stop_server(proc)


def test_node_events_and_metric_summaries_reach_kafka(kafka_bootstrap, tmp_path):
    import httpx
    from confluent_kafka import Consumer

    from torchrelay.wire import API_PREFIX, MetricBatch, MetricRecord, NodeRegistration

    topic = f"relay-events-{secrets.token_hex(3)}"
    proc, address = start_server(tmp_path / "home", f"kafka://{kafka_bootstrap}/{topic}",
                                 extra=("--heartbeat-timeout", "1"))
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topic, "auto.offset.reset": "earliest"})
    try:
        with httpx.Client(base_url=address + API_PREFIX, headers=bearer(address)) as http, \
                RelayClient(address) as client:
            job = client.submit({"name": "m", "entrypoint": "python -c pass"}, upload=False)
            reg = NodeRegistration(name="lonely", address="127.0.0.1", cpus=1, memory=2**30)
            http.post("/nodes/register", json=reg.model_dump()).raise_for_status()  # then no heartbeat: LOST
            points = [MetricRecord(rank=r, seq=i, step=i, time=time.time(), values={"loss": 1.0 + r})
                      for r in (0, 1) for i in range(3)]
            http.post(f"/jobs/{job.id}/metrics", json=MetricBatch(launch_id="x-n0", records=points).model_dump()
                      ).raise_for_status()
            consumer.subscribe([topic])
            got: dict[tuple[str, str], Event] = {}
            deadline = time.monotonic() + 60
            while not ({("node", "READY"), ("node", "LOST"), ("metrics", "")} <= set(got)):
                assert time.monotonic() < deadline, sorted(got)
                msg = consumer.poll(0.5)
                if msg is None or msg.error():
                    continue
                event = Event.from_body(msg.value())
                got[(event.kind, event.state)] = event
                assert msg.key() == event.key().encode()
            assert got[("node", "LOST")].node == "lonely" and got[("node", "READY")].seq < got[("node", "LOST")].seq
            summary = got[("metrics", "")]
            assert (summary.job_id, summary.step, summary.values) == (job.id, 2, {"loss": 1.5})
            client.cancel(job.id)
    finally:
        consumer.close()
        stop_server(proc)


# ---------------------------------------------------------------- bad URLs


def test_unreachable_broker_is_logged_and_retried_not_fatal(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc, address = start_server(tmp_path / "home", f"amqp://guest:guest@127.0.0.1:{port}/%2F")
    try:
        with RelayClient(address) as client:
            churn(client, 1)  # the control plane works with the broker away
            deadline = time.monotonic() + 30
            while "keeping them and retrying" not in (tmp_path / "home" / "server.log").read_text():
                assert time.monotonic() < deadline, (tmp_path / "home" / "server.log").read_text()
                time.sleep(0.2)
            assert proc.poll() is None
    finally:
        stop_server(proc)


def test_malformed_events_url_is_refused_at_start_naming_it(tmp_path):
    from torchrelay.errors import InvalidSpec
    from torchrelay.server.main import serve

    with pytest.raises(InvalidSpec, match="rabbit://somewhere"):  # before it binds or opens the store
        serve(port=0, home=tmp_path, events=["amqp://guest:guest@127.0.0.1:5672/%2F", "rabbit://somewhere"])
    assert not (tmp_path / "state.db").exists()
