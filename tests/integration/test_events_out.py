"""Events out: a real server process with ``--events`` and real brokers.

RabbitMQ: Debian's rabbitmq-server as a private node (tests/services/rabbitmq.py), stopped and
killed while events flow. Kafka: librdkafka's mock cluster (the confluent-kafka wheel's
``test.mock.num.brokers``), which speaks the Kafka protocol to the real client; a real broker
when ``RELAY_TEST_KAFKA`` names one (HOST:PORT).
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

    def __init__(self, url: str, exchange: str = "relay.events", queue: str | None = None):
        import pika

        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.url = url
        self.exchange = exchange
        self.queue = queue or f"test-{secrets.token_hex(4)}"
        self._declare()
        self.events: list[Event] = []

    def _declare(self) -> None:
        channel = self.connection.channel()
        channel.exchange_declare(self.exchange, exchange_type="topic", durable=True)
        channel.queue_declare(self.queue, durable=True)
        channel.queue_bind(self.queue, self.exchange, routing_key="job.#")
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
            assert (method.routing_key, props.delivery_mode, props.headers["seq"]) == \
                (f"job.{event.job_id}.state", 2, event.seq)
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
