"""Stream datasets: a Kafka topic read by two gloo ranks under torchrun, killed with SIGKILL and
resumed from its checkpoint, every record after the checkpoint trained on exactly once (counted);
RabbitMQ streams resumed from their offsets; the errors that fail a job at start.

Kafka: librdkafka's mock cluster (confluent-kafka's wheel) held by this test process, or a real
broker when ``RELAY_TEST_KAFKA`` names one. RabbitMQ: the session's private node.
This file is also the worker script torchrun starts (``python test_stream_data.py OUT MODE TOPIC BOOTSTRAP``).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
PARTITIONS, PER_PARTITION, BATCH, EVERY, KILL_AFTER = 4, 24, 4, 4, 10  # checkpoint at 8, killed after step 10


def decode(value: bytes):
    import torch

    record = json.loads(value)
    return torch.tensor(record["id"]), torch.tensor(record["x"]), torch.tensor([sum(record["x"])])


# ---------------------------------------------------------------- the worker (run by torchrun)


def worker(out_dir: str, mode: str, topic: str, bootstrap: str) -> None:
    import torch

    import torchrelay.train as rt

    ctx = rt.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    model, optimizer = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    loader = rt.kafka_loader(topic, bootstrap=bootstrap, decode=decode, batch_size=BATCH, num_workers=2)
    state = rt.TrainState(model, optimizer, loader)
    resumed = state.restore()
    log = open(Path(out_dir, f"trained-{mode}-{ctx.rank}.jsonl"), "a")
    for ids, x, y in state.batches():
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        log.write(json.dumps({"step": state.step, "ids": ids.tolist(), "resumed": resumed}) + "\n")
        log.flush()
        if state.step % EVERY == 0:
            state.save(async_=False)
        if mode == "killed" and state.step == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no shutdown, nothing flushed beyond this line
    log.close()
    rt.shutdown()
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------- the tests


@pytest.fixture
def kafka():
    """(bootstrap, producer) of a Kafka broker: ``RELAY_TEST_KAFKA``'s, else a mock cluster."""
    confluent_kafka = pytest.importorskip("confluent_kafka", reason="confluent-kafka is in the channels extra")
    if os.environ.get("RELAY_TEST_KAFKA"):
        bootstrap = os.environ["RELAY_TEST_KAFKA"]
        holder = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    else:
        holder = confluent_kafka.Producer({"test.mock.num.brokers": 1})
    broker = next(iter(holder.list_topics(timeout=10).brokers.values()))
    yield f"{broker.host}:{broker.port}", holder
    holder.flush(5)


def fill(producer, topic: str) -> set[int]:
    """PARTITIONS × PER_PARTITION records with distinct ids (the mock cluster makes 4 partitions)."""
    ids = set()
    for i in range(PARTITIONS * PER_PARTITION):
        producer.produce(topic, value=json.dumps({"id": i, "x": [i % 7, 1.0, -0.5]}).encode(),
                         partition=i % PARTITIONS)
        ids.add(i)
    assert producer.flush(20) == 0
    return ids


def launch(tmp_path: Path, mode: str, topic: str, bootstrap: str) -> None:
    from torchrun_helper import run_torchrun

    env = {"RELAY_STORE_URL": f"file://{tmp_path / 'store'}", "RELAY_JOB_ID": "j-stream",
           "RELAY_JOB_STORE_PREFIX": "jobs/j-stream", "RELAY_STRATEGY": json.dumps({"kind": "ddp"}),
           "RELAY_CHECKPOINT": json.dumps({"every_steps": EVERY, "keep": 2})}
    result = run_torchrun([str(Path(__file__).resolve()), str(tmp_path), mode, topic, bootstrap], nproc=2,
                          cwd=HERE, env=env)
    if mode == "killed":
        assert result.returncode != 0, result.stdout[-3000:]  # a rank died of SIGKILL
        assert "Signals.SIGKILL" in result.stdout or "-9" in result.stdout, result.stdout[-3000:]
    else:
        assert result.returncode == 0, result.stdout[-4000:]


def test_kafka_records_after_the_checkpoint_are_trained_exactly_once_across_a_kill_9(tmp_path, kafka):
    bootstrap, producer = kafka
    topic = f"relay-data-{secrets.token_hex(3)}"
    every_id = fill(producer, topic)
    launch(tmp_path, "killed", topic, bootstrap)
    launch(tmp_path, "resumed", topic, bootstrap)
    per_rank = PARTITIONS * PER_PARTITION // 2 // BATCH
    lineage: list[int] = []
    for rank in range(2):
        killed = [json.loads(line) for line in (tmp_path / f"trained-killed-{rank}.jsonl").read_text().splitlines()]
        resumed = [json.loads(line) for line in (tmp_path / f"trained-resumed-{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in killed][-1] >= KILL_AFTER - 1 and not killed[0]["resumed"]
        last_checkpoint = KILL_AFTER // EVERY * EVERY
        assert [r["step"] for r in resumed] == list(range(last_checkpoint + 1, per_rank + 1))
        assert all(r["resumed"] for r in resumed)
        mine = [i for r in killed if r["step"] <= last_checkpoint for i in r["ids"]]
        mine += [i for r in resumed for i in r["ids"]]
        assert len(mine) == len(set(mine)) == PARTITIONS * PER_PARTITION // 2  # each of its records once
        assert {i % PARTITIONS for i in mine} == {rank, rank + 2}  # its partitions, and only those
        lineage += mine
        # what the killed run trained after its checkpoint came again after the resume
        redone = {i for r in killed if r["step"] > last_checkpoint for i in r["ids"]}
        assert redone and redone <= {i for r in resumed for i in r["ids"]}
    assert sorted(lineage) == sorted(every_id)


def test_stream_errors_name_the_topic_and_the_counts(kafka, monkeypatch):
    from torchrelay.errors import StreamError
    from torchrelay.train.stream_data import kafka_loader

    bootstrap, producer = kafka
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    missing = kafka_loader("no-such-topic", bootstrap=bootstrap, decode=decode, batch_size=2)
    with pytest.raises(StreamError, match="'no-such-topic'.*does not exist"):
        next(iter(missing))
    topic = f"relay-data-{secrets.token_hex(3)}"
    fill(producer, topic)
    uneven = kafka_loader(topic, bootstrap=bootstrap, decode=decode, batch_size=2)
    with pytest.raises(StreamError, match=f"'{topic}'.*4 partition.*3 rank"):
        next(iter(uneven))


def decode_ids(values: list[bytes]):
    """``decode_batch``: a batch's ids at once."""
    import torch

    return torch.tensor([json.loads(v)["id"] for v in values])


def test_a_worker_hands_over_whole_fetches_and_a_stop_inside_one_keeps_the_rest(kafka, monkeypatch):
    """One worker hands over each fetch's batches at once (``decode_batch``); ``max_steps``
    ending inside such a hand-off leaves the position after the last batch handed out, so a
    loader restored from it reads every other record, each once."""
    from torchrelay.train.stream_data import kafka_loader

    bootstrap, producer = kafka
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    topic = f"relay-data-{secrets.token_hex(3)}"
    ids = fill(producer, topic)
    first = kafka_loader(topic, bootstrap=bootstrap, decode_batch=decode_ids, batch_size=BATCH, num_workers=1,
                         max_steps=5)
    seen = [int(i) for batch in first for i in batch]
    assert len(seen) == 5 * BATCH and first.steps == 5
    rest = kafka_loader(topic, bootstrap=bootstrap, decode_batch=decode_ids, batch_size=BATCH, num_workers=1)
    rest.load_state_dict(first.state_dict())
    later = [int(i) for batch in rest for i in batch]
    assert sorted(seen + later) == sorted(ids)  # every record once: none skipped, none twice
    with pytest.raises(ValueError, match="exactly one"):
        kafka_loader(topic, bootstrap=bootstrap, decode=decode, decode_batch=decode_ids, batch_size=BATCH)


def test_rabbitmq_stream_resumes_from_its_offsets(rabbitmq, monkeypatch):
    import pika

    from torchrelay.train.stream_data import rabbitmq_stream_loader

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    stream = f"relay-stream-{secrets.token_hex(3)}"
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq.url))
    channel = connection.channel()
    channel.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
    channel.confirm_delivery()
    for i in range(40):
        channel.basic_publish("", stream, json.dumps({"id": i, "x": [1.0, 2.0, 3.0]}).encode())
    connection.close()

    first = rabbitmq_stream_loader(stream, url=rabbitmq.url, decode=decode, batch_size=8, max_steps=3)
    seen = [int(i) for ids, _, _ in first for i in ids]
    assert seen == list(range(24))
    state = first.state_dict()
    assert state["offsets"] == {"0": 24} or int(state["offsets"]["0"]) > 23  # the next record's offset
    later = rabbitmq_stream_loader(stream, url=rabbitmq.url, decode=decode, batch_size=8, max_steps=5)
    later.load_state_dict(state)  # what TrainState restores: 3 steps done, the offsets after them
    rest = [int(i) for ids, _, _ in later for i in ids]
    assert rest == list(range(24, 40))  # exactly the records after, each once

    with pytest.raises(Exception, match="does not exist"):
        next(iter(rabbitmq_stream_loader("no-such-stream", url=rabbitmq.url, decode=decode, batch_size=2,
                                         max_steps=1)))


if __name__ == "__main__":
    worker(*sys.argv[1:5])
