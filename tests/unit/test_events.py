"""Events out, the pure parts: --events URLs, routing keys and bodies, the cursor rule (tables)."""
from __future__ import annotations

import time

import pytest

from torchrelay.errors import InvalidSpec
from torchrelay.server.events.model import Event, next_cursor
from torchrelay.server.events.urls import parse_sink_url


@pytest.mark.parametrize("url, kind, target, name", [
    ("amqp://guest:guest@127.0.0.1:5672/%2F", "amqp", "amqp://guest:guest@127.0.0.1:5672/%2F", "relay.events"),
    ("amqp://u:p@mq:5672/prod?exchange=ops.relay&heartbeat=30", "amqp", "amqp://u:p@mq:5672/prod?heartbeat=30",
     "ops.relay"),
    ("amqps://u:p@mq:5671/", "amqp", "amqps://u:p@mq:5671/", "relay.events"),
    ("kafka://127.0.0.1:9092/relay.events", "kafka", "127.0.0.1:9092", "relay.events"),
    ("kafka://a:9092,b:9093/ops", "kafka", "a:9092,b:9093", "ops"),
    ("kafka://a:9092", "kafka", "a:9092", "relay.events"),
])
def test_sink_urls(url, kind, target, name):
    got = parse_sink_url(url)
    assert (got.kind, got.target, got.name) == (kind, target, name)
    assert "p@" not in got.redacted and ":p@" not in got.redacted


@pytest.mark.parametrize("url, says", [
    ("rabbit://h:5672/", "scheme 'rabbit'"), ("amqp://:5672/", "no host"), ("amqp://h/", "no port"),
    ("amqp://h:99999/", "not a URL"), ("kafka://h/t", "HOST:PORT"), ("kafka://h:9092/a/b", "nothing after"),
    ("kafka://h:9092/bad topic", "not a usable"), ("amqp://h:5672/?exchange=", "not a usable"), ("", "scheme ''"),
])
def test_malformed_sink_urls_are_refused_naming_them(url, says):
    with pytest.raises(InvalidSpec) as err:
        parse_sink_url(url)
    assert repr(url) in str(err.value) and says in str(err.value)


def ev(seq: int, job: str = "job-1") -> Event:
    return Event(seq=seq, time=1.5, job_id=job, state="RUNNING", message="started")


def test_routing_key_and_body_round_trip():
    event = ev(7, "job-12")
    assert event.routing_key() == "job.job-12.state"
    assert Event.from_body(event.body()) == event


@pytest.mark.parametrize("cursor, seqs, confirmed, expect", [
    (0, [1, 2, 3], 3, 3), (0, [1, 2, 3], 1, 1), (5, [6, 9], 0, 5), (5, [7, 9], 2, 9),
    (5, [5, 6], 2, ValueError), (0, [2, 1], 2, ValueError), (0, [1], 2, ValueError),
])
def test_the_cursor_moves_only_past_confirmed_events_in_order(cursor, seqs, confirmed, expect):
    batch = [ev(s) for s in seqs]
    if expect is ValueError:
        with pytest.raises(ValueError):
            next_cursor(cursor, batch, confirmed)
    else:
        assert next_cursor(cursor, batch, confirmed) == expect


@pytest.mark.parametrize("event, key, body_has", [
    (Event(seq=1, time=0.0, job_id="job-3", state="QUEUED", message="submitted"), "job.job-3.state",
     {"job": "job-3", "state": "QUEUED", "message": "submitted", "kind": "state"}),
    (Event(seq=2, time=0.0, kind="node", node="gpu-07", state="LOST"), "node.gpu-07.state",
     {"node": "gpu-07", "state": "LOST", "kind": "node"}),
    (Event(seq=9, time=0.0, kind="metrics", job_id="job-3", step=40, values={"loss": 0.5}), "job.job-3.metrics",
     {"job": "job-3", "step": 40, "values": {"loss": 0.5}, "kind": "metrics"}),
    (Event(seq=11, time=0.0, kind="checkpoint", job_id="job-3", state="RUNNING", message="checkpoint of step 8 …",
           step=8, attempt=2, url="s3://b/jobs/job-3/checkpoints/step-0000000008"), "job.job-3.checkpoint",
     {"job": "job-3", "state": "RUNNING", "step": 8, "attempt": 2, "kind": "checkpoint",
      "url": "s3://b/jobs/job-3/checkpoints/step-0000000008"}),
])
def test_each_feed_has_its_routing_key_and_body(event, key, body_has):
    import json

    assert event.routing_key() == key
    body = json.loads(event.body())
    assert {k: body[k] for k in body_has} == body_has and body["seq"] == event.seq
    assert Event.from_body(event.body()) == event


def test_metric_summaries_take_each_ranks_latest_point_per_job():
    from torchrelay.server.events.model import metric_summaries

    rows = [(10, "job-1", 0, 5, 1.0, {"loss": 4.0}), (11, "job-1", 1, 5, 1.1, {"loss": 2.0}),
            (12, "job-2", 0, 1, 1.2, {"acc": 0.5}), (13, "job-1", 0, 6, 1.3, {"loss": 1.0, "lr": 0.1})]
    got = metric_summaries(rows)
    assert [(e.job_id, e.seq, e.step) for e in got] == [("job-2", 12, 1), ("job-1", 13, 6)]
    assert got[1].values == {"loss": 1.5, "lr": 0.1} and got[1].time == 1.3  # rank 0's step 6 and rank 1's step 5
    assert metric_summaries([]) == []


class _RecordingSink:
    """Stands in for a broker: this test is about when the relay publishes, not how."""

    def __init__(self):
        self.seen: list[tuple[str, int]] = []

    def publish(self, events):
        self.seen.extend((e.kind, e.seq) for e in events)
        return len(events)

    def close(self):
        pass


def test_only_an_active_relay_publishes_and_it_resumes_from_the_stored_cursor(tmp_path):
    """Among servers sharing a store only the leader's relay publishes; one that becomes the
    leader starts after the cursor the previous leader stored, so nothing is sent twice."""
    import threading

    from torchrelay.server.events.relay import EventRelay
    from torchrelay.server.events.urls import parse_sink_url
    from torchrelay.server.store import NodeEventRow, make_engine, make_sessionmaker

    engine = make_engine(f"sqlite:///{tmp_path / 'state.db'}")
    with make_sessionmaker(engine)() as s:
        s.add_all([NodeEventRow(node_id="n1", node_name="a", time=1.0, state="READY"),
                   NodeEventRow(node_id="n1", node_name="a", time=2.0, state="LOST")])
        s.commit()
    url = parse_sink_url("amqp://127.0.0.1:1/")
    leading = threading.Event()
    first, second = _RecordingSink(), _RecordingSink()
    follower = EventRelay(url, engine, sink=first, idle_s=0.01, active=leading.is_set)
    follower.start()
    try:
        time.sleep(0.3)
        assert first.seen == []  # a follower publishes nothing
        leading.set()
        deadline = time.monotonic() + 30
        while len(first.seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.seen == [("node", 1), ("node", 2)]
    finally:
        follower.stop()
    with make_sessionmaker(engine)() as s:
        s.add(NodeEventRow(node_id="n1", node_name="a", time=3.0, state="READY"))
        s.commit()
    successor = EventRelay(url, engine, sink=second, idle_s=0.01)
    successor.start()
    try:
        deadline = time.monotonic() + 30
        while not second.seen and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert second.seen == [("node", 3)]
    finally:
        successor.stop()


@pytest.mark.parametrize("kind, detail, expect", [
    (None, None, ("state", None, None, "")),
    ("checkpoint", {"step": 8, "attempt": 2, "url": "file:///s/step-0000000008"},
     ("checkpoint", 8, 2, "file:///s/step-0000000008")),
    ("checkpoint", None, ("state", None, None, "")),  # a row without its detail is shown as what it says
])
def test_a_job_event_row_is_a_state_or_a_checkpoint_event(kind, detail, expect):
    from torchrelay.server.events.model import job_event

    event = job_event(5, "job-2", 1.0, "RUNNING", "m", kind, detail)
    assert (event.kind, event.step, event.attempt, event.url) == expect
    assert (event.seq, event.job_id, event.state, event.message) == (5, "job-2", "RUNNING", "m")
    assert event.routing_key() == f"job.job-2.{expect[0]}"


@pytest.mark.parametrize("step, url, says", [
    (-1, "file:///x", "step -1"), (True, "file:///x", "step True"), ("3", "file:///x", "step '3'"),
    (3, "", "url ''"), (3, "a\nb", "url 'a\\nb'"), (3, "x" * 3000, "at most 2048"), (3, None, "url None"),
])
def test_a_bad_checkpoint_commit_is_refused_naming_the_value(step, url, says):
    from torchrelay.server.events.model import checkpoint_detail

    with pytest.raises(ValueError) as err:
        checkpoint_detail(step, 1, url)
    assert says in str(err.value)


def test_a_checkpoint_commit_detail_and_message():
    from torchrelay.server.events.model import checkpoint_detail, checkpoint_message

    assert checkpoint_detail(0, 3, "file:///c/step-0000000000") == {"step": 0, "attempt": 3,
                                                                    "url": "file:///c/step-0000000000"}
    assert checkpoint_message(8, 2, "s3://b/c") == "checkpoint of step 8 committed by attempt 2: s3://b/c"


def test_a_checkpoint_commit_is_one_job_event_and_a_checkpoint_event_of_the_state_feed(tmp_path, db_url):
    """The server's side on a real store (SQLite and PostgreSQL): recorded once however often it
    is posted, listed with the job's events, read by the relay as a ``checkpoint`` event."""
    from torchrelay.server.events.relay import read_job_events
    from torchrelay.server.service import ClusterService

    svc = ClusterService(db_url, str(tmp_path / "store"), heartbeat_timeout_s=10)
    try:
        job = svc.submit({"name": "t", "entrypoint": "python x.py", "workers": 1}, None, None)
        url = "file:///s/jobs/job-1/checkpoints/step-0000000008"
        assert svc.checkpoint_committed(job.id, 1, 8, url) is True
        assert svc.checkpoint_committed(job.id, 1, 8, url) is False  # a retry whose reply was lost
        with pytest.raises(InvalidSpec, match="step -1"):
            svc.checkpoint_committed(job.id, 1, -1, url)
        assert [e.message for e in svc.get_job(job.id).events] == [
            "submitted", f"checkpoint of step 8 committed by attempt 1: {url}"]
        events = read_job_events(svc.db.engine, 0)
        assert [(e.kind, e.routing_key(), e.step, e.attempt, e.url) for e in events] == [
            ("state", f"job.{job.id}.state", None, None, ""), ("checkpoint", f"job.{job.id}.checkpoint", 8, 1, url)]
    finally:
        svc.stop()
