"""The cluster's other channels, side by side in one run: events out, stream data in, MPI.

- events: our AMQP sink publishing ``--events`` job events with publisher confirms (persistent,
  to a durable queue) vs raw pika publishing the same bodies the same way: events/s; then a real
  server with ``--events amqp://…`` while jobs are submitted and cancelled: the latency from the
  server's commit of an event (its ``time``) to a consumer's receipt, p50/p95. RabbitMQ: a
  private node (tests/services/rabbitmq.py).
- kafka: ``rt.kafka_loader`` vs a raw confluent-kafka consumer of the same topic (``consume``
  of up to 1,000 messages a call, no more than are left), both decoding and collating the same records (librdkafka's mock cluster, or ``--kafka HOST:PORT``): records/s.
- stream training: the digits MLP's step time reading its batches from that topic (binary
  records, one DataLoader worker, ``decode_batch``: a batch decoded at once) vs from memory (a
  ``TensorDataset`` DataLoader): ratio memory / stream; and the same with ``decode`` per record.
- mpi: an allreduce of 100 MB through mpi4py, 2 ranks on one node, launched by the platform
  (an mpirun job in an embedded cluster) vs ``mpirun`` by hand with the same Open MPI settings:
  ratio hand / platform of the median allreduce time.

Ends with ``RESULT {"events_per_s", "event_latency_p95_ms", "kafka_vs_raw",
"stream_train_step_ratio", "mpi_allreduce_ratio", ...}``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/queues.py [--events 5000] [--skip-mpi]
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _env import header_line, package_versions, result_line  # noqa: E402

PACKAGES = ("torch", "pika", "confluent-kafka", "mpi4py", "sqlalchemy", "uvicorn")

ALLREDUCE = r'''
import sys, time, statistics
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
buf = np.ones(25_000_000, dtype=np.float32)  # 100 MB
out = np.empty_like(buf)
times = []
for _ in range(int(sys.argv[1])):
    comm.Barrier()
    t = time.perf_counter()
    comm.Allreduce(buf, out, op=MPI.SUM)
    times.append(time.perf_counter() - t)
if comm.Get_rank() == 0:
    print("ALLREDUCE_MEDIAN_S", statistics.median(times[1:] or times), flush=True)
'''


def row(name: str, ours: float, base: float, unit: str, ratio: float) -> None:
    print(f"{name:<34} ours {ours:>12,.1f} {unit:<10} baseline {base:>12,.1f} {unit:<10} ratio {ratio:.3f}")


# ---------------------------------------------------------------- events


def bench_events(node, count: int) -> dict:
    import pika

    from torchrelay.server.events.model import Event
    from torchrelay.server.events.relay import BATCH
    from torchrelay.server.events.sinks import AmqpSink
    from torchrelay.server.events.urls import parse_sink_url

    events = [Event(seq=i + 1, time=time.time(), job_id=f"job-{i % 50}", state="RUNNING", message="bench")
              for i in range(count)]
    queue = f"bench-{secrets.token_hex(3)}"
    setup = pika.BlockingConnection(pika.URLParameters(node.url)).channel()
    setup.exchange_declare("relay.events", exchange_type="topic", durable=True)
    setup.queue_declare(queue, durable=True)
    setup.queue_bind(queue, "relay.events", "job.#")

    sink = AmqpSink(parse_sink_url(node.url))
    sink.publish(events[:10])  # connect outside the timing
    t = time.perf_counter()
    for i in range(0, count, BATCH):  # in the relay's batches
        assert sink.publish(events[i:i + BATCH]) == len(events[i:i + BATCH])
    ours = count / (time.perf_counter() - t)
    sink.close()

    raw = pika.BlockingConnection(pika.URLParameters(node.url)).channel()
    raw.confirm_delivery()
    props = pika.BasicProperties(delivery_mode=2, content_type="application/json")
    t = time.perf_counter()
    for event in events:
        raw.basic_publish("relay.events", event.routing_key(), event.body(), properties=props)
    base = count / (time.perf_counter() - t)
    setup.queue_delete(queue)
    row("events published/s (confirms)", ours, base, "events/s", ours / base)
    return {"events_per_s": round(ours, 1), "raw_pika_events_per_s": round(base, 1)}


def bench_event_latency(node, jobs: int) -> dict:
    import pika

    from torchrelay.client.sdk import RelayClient
    from torchrelay.home import read_json, server_file
    from torchrelay.server.events.model import Event

    home = Path(tempfile.mkdtemp(prefix="relay-bench-ev-"))
    channel = pika.BlockingConnection(pika.URLParameters(node.url)).channel()
    channel.exchange_declare("relay.events", exchange_type="topic", durable=True)
    queue = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(queue, "relay.events", "job.#")
    proc = subprocess.Popen([sys.executable, "-m", "torchrelay.client.cli.main", "server", "--port", "0",
                             "--events", node.url], env={**os.environ, "RELAY_HOME": str(home)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latencies: list[float] = []
    try:
        while not (info := read_json(server_file(home))) or info.get("pid") != proc.pid:
            time.sleep(0.05)
        with RelayClient(info["address"], token=(home / "admin.token").read_text().strip()) as client:
            for _ in range(jobs):
                job = client.submit({"name": "ev", "entrypoint": "python -c pass"}, upload=False)
                client.cancel(job.id)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    method, _, body = channel.basic_get(queue, auto_ack=True)
                    if method is None:
                        if len(latencies) and time.monotonic() > deadline - 9.5:
                            break
                        time.sleep(0.002)
                        continue
                    latencies.append(time.time() - Event.from_body(body).time)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(10)
        shutil.rmtree(home, ignore_errors=True)
    p50 = statistics.median(latencies) * 1000
    p95 = statistics.quantiles(latencies, n=20)[-1] * 1000
    print(f"{'event latency server -> consumer':<34} p50 {p50:.1f} ms  p95 {p95:.1f} ms  ({len(latencies)} events)")
    return {"event_latency_p50_ms": round(p50, 1), "event_latency_p95_ms": round(p95, 1)}


# ---------------------------------------------------------------- kafka


def decode(value: bytes):
    """A record: the 64 pixels as float32 bytes, then the label byte (a binary format: a JSON
    record costs more to decode than the MLP's step on it)."""
    import torch

    return torch.frombuffer(bytearray(value[:256]), dtype=torch.float32), torch.tensor(value[256])


def decode_batch(values: list[bytes]):
    """A whole batch of records at once (``decode_batch=``): numpy over the joined bytes, no
    Python work per record."""
    import numpy as np
    import torch

    raw = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), 257)
    return torch.from_numpy(raw[:, :256].copy().view(np.float32)), torch.from_numpy(raw[:, 256].astype(np.int64))


def fill_digits(bootstrap: str, topic: str, repeat: int) -> int:
    from confluent_kafka import Producer
    from sklearn.datasets import load_digits

    digits = load_digits()
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    n = 0
    for _ in range(repeat):
        for x, y in zip(digits.data, digits.target):
            value = (x / 16).astype("float32").tobytes() + bytes([int(y)])
            producer.produce(topic, value=value, partition=n % 4)
            n += 1
        producer.poll(0)
    producer.flush(60)
    return n


def raw_kafka(bootstrap: str, topic: str, total: int, batch: int) -> float:
    from confluent_kafka import Consumer, TopicPartition
    from torch.utils.data import default_collate

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "raw", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(4)])
    got, pending = 0, []
    t = time.perf_counter()
    while got < total:
        # no more than are left: consume(1000) would wait out its timeout for the last ones
        for msg in consumer.consume(num_messages=min(1000, total - got), timeout=0.5):
            if msg.error():
                continue
            pending.append(decode(msg.value()))
            got += 1
            if len(pending) == batch:
                default_collate(pending)
                pending = []
    elapsed = time.perf_counter() - t
    consumer.close()
    return total / elapsed


def ours_kafka(bootstrap: str, topic: str, total: int, batch: int) -> float:
    import torchrelay.train as rt

    loader = rt.kafka_loader(topic, bootstrap=bootstrap, decode=decode, batch_size=batch)
    got = 0
    t = time.perf_counter()
    for x, _ in loader:
        got += len(x)
    elapsed = time.perf_counter() - t
    assert got == total, (got, total)
    return total / elapsed


def train_steps(batches, steps: int) -> float:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    done, t = 0, None
    for x, y in batches:
        if done == 10:
            t = time.perf_counter()  # after a warm-up
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
        if done == steps + 10:
            break
    return (time.perf_counter() - t) / steps


def bench_kafka(bootstrap: str) -> dict:
    import torch
    from sklearn.datasets import load_digits

    topic = f"bench-digits-{secrets.token_hex(3)}"
    total = fill_digits(bootstrap, topic, repeat=4)
    batch = 64
    raw = statistics.median(raw_kafka(bootstrap, topic, total, batch) for _ in range(3))
    ours = statistics.median(ours_kafka(bootstrap, topic, total, batch) for _ in range(3))
    row("kafka records/s (decode+collate)", ours, raw, "records/s", ours / raw)

    import torchrelay.train as rt

    digits = load_digits()
    memory = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.tensor(digits.data / 16, dtype=torch.float32).repeat(4, 1), torch.tensor(digits.target).repeat(4)),
        batch_size=batch, shuffle=True)
    steps = total // batch - 12
    mem_s = statistics.median(train_steps(memory, steps) for _ in range(3))
    stream_s, record_s = [], []
    for _ in range(3):  # interleaved; one DataLoader worker reads and decodes while the step runs
        stream_s.append(train_steps(rt.kafka_loader(topic, bootstrap=bootstrap, decode_batch=decode_batch,
                                                    batch_size=batch, num_workers=1), steps))
        record_s.append(train_steps(rt.kafka_loader(topic, bootstrap=bootstrap, decode=decode,
                                                    batch_size=batch, num_workers=1), steps))
    stream_s, record_s = statistics.median(stream_s), statistics.median(record_s)
    row("digits step time, ms", stream_s * 1000, mem_s * 1000, "ms", mem_s / stream_s)
    row("  the same, decode per record, ms", record_s * 1000, mem_s * 1000, "ms", mem_s / record_s)
    return {"kafka_records_per_s": round(ours, 1), "raw_kafka_records_per_s": round(raw, 1),
            "kafka_vs_raw": round(ours / raw, 3), "stream_step_ms": round(stream_s * 1000, 3),
            "memory_step_ms": round(mem_s * 1000, 3), "stream_train_step_ratio": round(mem_s / stream_s, 3),
            "stream_step_per_record_decode_ms": round(record_s * 1000, 3),
            "stream_train_step_ratio_per_record_decode": round(mem_s / record_s, 3)}


# ---------------------------------------------------------------- mpi


def bench_mpi(rounds: int) -> dict:
    from torchrelay.agent.mpi import mpirun_env
    from torchrelay.client.cluster import start_cluster, stop_cluster
    from torchrelay.client.sdk import RelayClient
    from torchrelay.spec import JobSpec, JobState

    work = Path(tempfile.mkdtemp(prefix="relay-bench-mpi-"))
    (work / "job").mkdir()
    (work / "job" / "allreduce.py").write_text(ALLREDUCE)
    env = {**os.environ, **mpirun_env("127.0.0.1"), "OMP_NUM_THREADS": "1"}
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    hand_times, platform_times = [], []
    cluster = start_cluster(1, home=work / "home")
    try:
        with RelayClient(cluster.address) as client:
            for _ in range(2):  # interleaved: by hand, then through the platform
                out = subprocess.run(["mpirun", *root, "-np", "2", sys.executable, "allreduce.py", str(rounds)],
                                     cwd=work / "job", env=env, capture_output=True, text=True, timeout=300)
                hand_times.append(float(out.stdout.split("ALLREDUCE_MEDIAN_S")[1].split()[0]))
                spec = JobSpec.parse({"name": "allreduce", "entrypoint": f"python allreduce.py {rounds}",
                                      "nodes": 1, "workers_per_node": 2, "launcher": "mpirun"})
                job = client.submit(spec, base_dir=work / "job")
                final = client.wait(job.id, timeout=300)
                assert final.state == JobState.SUCCEEDED, final.failure
                line = next(x.text for x in client.iter_logs(job.id) if "ALLREDUCE_MEDIAN_S" in x.text)
                platform_times.append(float(line.split()[1]))
    finally:
        stop_cluster(cluster.home)
        shutil.rmtree(work, ignore_errors=True)
    hand, plat = statistics.median(hand_times), statistics.median(platform_times)
    row("mpi allreduce 100 MB, 2 ranks, ms", plat * 1000, hand * 1000, "ms", hand / plat)
    return {"mpi_allreduce_platform_ms": round(plat * 1000, 2), "mpi_allreduce_hand_ms": round(hand * 1000, 2),
            "mpi_allreduce_ratio": round(hand / plat, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--latency-jobs", type=int, default=40)
    parser.add_argument("--kafka", default=None, help="HOST:PORT of a real broker (default: a mock cluster)")
    parser.add_argument("--mpi-rounds", type=int, default=8)
    parser.add_argument("--skip-mpi", action="store_true")
    args = parser.parse_args()
    versions = package_versions(PACKAGES)
    print(header_line(versions))
    print(f"load average: {os.getloadavg()[0]:.1f}")
    result: dict = {}

    from tests.services.rabbitmq import RabbitMQ

    node = RabbitMQ(Path(tempfile.mkdtemp(prefix="relay-bench-mq-")))
    try:
        node.start()
        result.update(bench_events(node, args.events))
        result.update(bench_event_latency(node, args.latency_jobs))
    finally:
        node.close()
        shutil.rmtree(node.root, ignore_errors=True)

    import confluent_kafka

    holder = None
    bootstrap = args.kafka
    if bootstrap is None:
        holder = confluent_kafka.Producer({"test.mock.num.brokers": 1})
        broker = next(iter(holder.list_topics(timeout=10).brokers.values()))
        bootstrap = f"{broker.host}:{broker.port}"
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    result.update(bench_kafka(bootstrap))
    result["kafka_broker"] = "real" if args.kafka else "librdkafka mock cluster"
    if not args.skip_mpi:
        result.update(bench_mpi(args.mpi_rounds))
    result["load_average"] = round(os.getloadavg()[0], 1)
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
