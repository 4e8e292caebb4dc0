"""Training data from a Kafka topic or RabbitMQ streams, resumed exactly where a checkpoint left it.

    loader = rt.kafka_loader("clicks", bootstrap="k1:9092", decode=parse, batch_size=64, num_workers=2)
    state = rt.TrainState(model, optimizer, loader)       # the offsets ride with the checkpoint
    state.restore()
    for x, y in state.batches():                          # until the end offsets, or max_steps
        ...

Contract:
- ``kafka_loader(topic, bootstrap=…)`` / ``rabbitmq_stream_loader(streams, url=…)``: a
  ``StreamLoader``, an iterable of batches. Partitions (Kafka partitions; for RabbitMQ each
  named stream is one partition) are assigned to ranks and DataLoader workers by
  ``stream_plan.assign``: fixed for the run, no consumer group, no rebalance. Each worker
  decodes records with ``decode(bytes) -> sample`` and collates ``batch_size`` of them
  (``torch.utils.data.default_collate``), or, given ``decode_batch(list[bytes]) -> batch``
  instead, makes each batch from its records' values in one call (no Python work per record:
  e.g. numpy over the joined bytes); a batch holds records of one partition. A worker hands
  over the batches of each fetch at once, their tensors as numpy arrays through its pipe.
- ``bounded=True`` (Kafka's default) reads up to each partition's end offset as it was when the
  loader first started; ``bounded=False`` reads on, waiting for new records, until
  ``max_steps`` batches (``StreamLoader`` stops there; required when unbounded). RabbitMQ
  streams are read unbounded.
- The loader's position is, per partition, the offset after the last record of the last batch
  it handed out: a ``train.resumable.ResumableStream`` (``set_epoch``, ``state_dict``,
  ``load_state_dict``), which ``TrainState`` saves per rank with the checkpoint. After a restore the next batch starts at
  the first record after the checkpoint: every record after it is trained on exactly once, as
  long as the world size and ``batch_size`` are the same.
- At the first iteration, a Kafka topic that does not exist, a stream that does not exist, or a
  partition count that cannot be split over the ranks raises ``StreamError`` naming the topic
  and the counts (the job fails at start with it).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_convert, get_worker_info
from torch.utils.data._utils.collate import collate, default_collate_fn_map  # what default_collate's docs extend

from torchrelay.errors import StreamError
from torchrelay.train.session import current_session
from torchrelay.train.stream_plan import Position, assign

Decode = Callable[[bytes], Any]
DecodeBatch = Callable[[list[bytes]], Any]
CHUNK = 1000  # records a Kafka consumer hands over per call at most
POLL_S = 0.5  # how long one call waits for a record when none is fetched yet


# A source (``KafkaSource``, ``RabbitStreamSource``): ``name`` for messages; ``count()`` its
# partitions (raises ``StreamError`` when it does not exist); ``ends(partitions)`` the end
# offsets of a bounded read (None: unbounded); ``records(starts, ends)`` yields lists of
# ``(partition, offset, value)`` (each what one fetch brought), in offset order per partition,
# from ``starts`` to ``ends``; ``release()`` (optional) closes what ``count``/``ends`` opened.


class KafkaSource:
    def __init__(self, topic: str, bootstrap: str, options: dict[str, Any] | None = None, timeout_s: float = 10.0):
        self.topic, self.bootstrap, self.options, self.timeout_s = topic, bootstrap, dict(options or {}), timeout_s
        self.name = f"Kafka topic {topic!r} at {bootstrap}"
        self._consumer = None

    def _new_consumer(self) -> Any:
        from confluent_kafka import Consumer  # local: only jobs that read Kafka need it

        # no group management: partitions are assigned by hand (``assign``), offsets live in
        # the checkpoint, never committed to Kafka
        return Consumer({"bootstrap.servers": self.bootstrap, "group.id": "torchrelay-unused",
                         "enable.auto.commit": False, "enable.partition.eof": True,
                         "auto.offset.reset": "earliest", **self.options})

    def _meta(self) -> Any:
        """One consumer for ``count`` and ``ends`` (each consumer costs a connection and a
        close), until ``release``."""
        if self._consumer is None:
            self._consumer = self._new_consumer()
        return self._consumer

    def release(self) -> None:
        """Close the consumer of ``count`` and ``ends`` before a DataLoader forks its workers
        (librdkafka's threads do not survive a fork); without workers ``records`` reads with it."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()

    def count(self) -> int:
        meta = self._meta().list_topics(self.topic, timeout=self.timeout_s).topics.get(self.topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise StreamError(f"{self.name} does not exist ({meta.error if meta is not None else 'not listed'}); "
                              "create it, or name an existing topic")
        return len(meta.partitions)

    def ends(self, partitions: list[int]) -> dict[int, int]:
        from confluent_kafka import TopicPartition

        consumer = self._meta()
        return {p: consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=self.timeout_s)[1]
                for p in partitions}

    @staticmethod
    def _fetch(consumer: Any) -> list[Any]:
        """What librdkafka has fetched already (up to ``CHUNK``, without waiting), or else the
        next message as soon as one comes (at most ``POLL_S``). Never ``consume(n, timeout)``
        with a fixed ``n``: it waits out the whole timeout for the last records of a bounded
        read (0.5 s: 5 ms a step over a 100-step run) and for every slow batch of an unbounded one."""
        return consumer.consume(num_messages=CHUNK, timeout=0) or consumer.consume(num_messages=1, timeout=POLL_S)

    def records(self, starts: dict[int, int], ends: dict[int, int] | None) -> Iterator[list[tuple[int, int, bytes]]]:
        from confluent_kafka import KafkaError, TopicPartition

        consumer, self._consumer = self._consumer or self._new_consumer(), None  # count's, if not released
        try:
            todo = {p for p in starts if ends is None or starts[p] < ends[p]}
            if not todo:
                return
            consumer.assign([TopicPartition(self.topic, p, starts[p]) for p in sorted(todo)])
            while todo:
                chunk = []
                for msg in self._fetch(consumer):
                    p, offset = msg.partition(), msg.offset()
                    if msg.error():
                        if msg.error().code() != KafkaError._PARTITION_EOF:
                            raise StreamError(f"{self.name}: {msg.error()}")
                        if ends is not None and offset >= ends[p]:
                            todo.discard(p)  # its end offset reached (it may be no record's: a gap)
                        continue
                    if ends is not None and offset >= ends[p]:
                        todo.discard(p)
                        continue
                    chunk.append((p, offset, msg.value()))
                    if ends is not None and offset + 1 >= ends[p]:
                        todo.discard(p)
                if chunk:
                    yield chunk
        finally:
            consumer.close()


class RabbitStreamSource:
    """RabbitMQ streams (3.9+), read over AMQP 0-9-1 with ``x-stream-offset``: each named stream
    is one partition; a record's offset is the ``x-stream-offset`` the broker gives it."""

    def __init__(self, streams: list[str], url: str, prefetch: int = 500):
        self.streams, self.url, self.prefetch = list(streams), url, prefetch
        self.name = f"RabbitMQ streams {self.streams!r}"

    def count(self) -> int:
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            for stream in self.streams:
                channel = connection.channel()
                try:
                    channel.queue_declare(stream, passive=True)
                except pika.exceptions.ChannelClosedByBroker as exc:
                    raise StreamError(f"RabbitMQ stream {stream!r} does not exist ({exc}); declare it with "
                                      "x-queue-type=stream") from None
        finally:
            connection.close()
        return len(self.streams)

    def ends(self, partitions: list[int]) -> None:
        return None  # read unbounded

    def records(self, starts: dict[int, int], ends: None) -> Iterator[list[tuple[int, int, bytes]]]:
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        pending: list[tuple[int, int, bytes]] = []
        try:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=self.prefetch)  # streams need a prefetch and acks

            for p, start in starts.items():
                def on_message(ch, method, props, body, p=p):  # noqa: ANN001 - pika's callback
                    pending.append((p, int(props.headers["x-stream-offset"]), body))
                    ch.basic_ack(method.delivery_tag)

                channel.basic_consume(self.streams[p], on_message, arguments={"x-stream-offset": start})
            while True:
                connection.process_data_events(time_limit=0.5)
                if pending:
                    chunk = pending[:]
                    pending.clear()
                    yield chunk
        finally:
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - the loop may end on a broken connection
                pass


class _Batches(IterableDataset):
    """One rank's batches: in each DataLoader worker, that worker's partitions from the
    position, ``batch_size`` records of one partition per batch, each with the last offset it
    holds. Yields lists of ``(batch, {partition: last offset})``: the batches completed by one
    fetch, handed over at once (one hand-off per fetch, not per batch; ``_pack``)."""

    def __init__(self, source: Any, *, rank: int, world: int, make: DecodeBatch, batch_size: int,
                 start: Position, ends: dict[int, int] | None):
        super().__init__()
        self.source, self.rank, self.world = source, rank, world
        self.make, self.batch_size, self.start, self.ends = make, batch_size, start, ends

    def __iter__(self) -> Iterator[list[tuple[Any, dict[int, int]]]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        mine = assign(self.source.partitions, world=self.world, rank=self.rank, workers=workers, worker=worker,
                      stream=self.source.name)
        starts = {p: self.start.start(p, 0) for p in mine}
        ends = None if self.ends is None else {p: self.ends[p] for p in mine}
        pack = _pack if info is not None else _same
        open_batches: dict[int, list[Any]] = {}
        last: dict[int, int] = {}
        make, size = self.make, self.batch_size
        for chunk in self.source.records(starts, ends):
            ready = []
            for partition, offset, value in chunk:
                batch = open_batches.setdefault(partition, [])
                batch.append(value)
                last[partition] = offset
                if len(batch) == size:
                    ready.append((make(batch), {partition: offset}))
                    open_batches[partition] = []
            if ready:
                yield pack(ready)
        tail = [(make(batch), {partition: last[partition]})  # a bounded stream's short last batches
                for partition, batch in open_batches.items() if batch]
        if tail:
            yield pack(tail)


class _Array:
    """A tensor crossing from a DataLoader worker to the training process as a numpy array,
    pickled by value through the worker's pipe. A tensor itself would cross as a shared-memory
    segment whose file descriptor is handed over a socket of its own, with an authentication
    handshake, per tensor: about a millisecond each on a busy 2-core machine, more than a
    small model's whole step."""

    __slots__ = ("array",)

    def __init__(self, array: Any):
        self.array = array

    def __reduce__(self) -> tuple:
        return _Array, (self.array,)


def _same(value: Any) -> Any:
    return value


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to each leaf of the containers ``default_collate`` makes
    (dicts, lists, tuples, named tuples)."""
    if isinstance(value, dict):
        walked = {k: _walk(v, leaf) for k, v in value.items()}
        if type(value) is not dict:
            try:
                return type(value)(walked)  # an OrderedDict stays one; a defaultdict cannot be rebuilt so
            except TypeError:
                pass
        return walked
    if isinstance(value, tuple):
        items = [_walk(v, leaf) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items) if type(value) is tuple \
            else type(value)(items)
    if isinstance(value, list):
        return [_walk(v, leaf) for v in value]
    return leaf(value)


def _to_array(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad:
        try:
            return _Array(value.numpy())
        except (TypeError, RuntimeError):  # no numpy dtype (bfloat16, quantized): as a tensor, shared
            return value
    return value


def _from_array(value: Any) -> Any:
    return torch.from_numpy(value.array) if isinstance(value, _Array) else value


def _pack(batches: Any) -> Any:
    return _walk(batches, _to_array)


def _unpack(batches: Any) -> Any:
    return _walk(batches, _from_array)


def _stack(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    return torch.stack(batch, 0)


# ``default_collate`` but for where a tensor's batch is made: in ordinary memory. In a worker,
# ``default_collate`` makes it in a new shared-memory segment (a third of a small batch's
# collate time), which is of no use: the batches cross as numpy arrays (``_pack``)
_PLAIN = {**default_collate_fn_map, torch.Tensor: _stack}


class _Collated:
    """A batch from its records' values: each decoded by ``decode``, then collated as
    ``default_collate`` does (``_PLAIN``)."""

    def __init__(self, decode: Decode):
        self.decode = decode

    def __call__(self, values: list[bytes]) -> Any:
        decode = self.decode
        return collate([decode(v) for v in values], collate_fn_map=_PLAIN)


class StreamLoader:
    """Batches of a stream for this rank, with the position ``TrainState`` checkpoints."""

    def __init__(self, source: Any, *, decode: Decode | None = None, batch_size: int, num_workers: int = 0,
                 bounded: bool = True, max_steps: int | None = None, decode_batch: DecodeBatch | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if (decode is None) == (decode_batch is None):
            raise ValueError(f"give decode (one record -> a sample) or decode_batch (a batch's records -> "
                             f"the batch), exactly one; got decode={decode!r}, decode_batch={decode_batch!r}")
        self.make = decode_batch or _Collated(decode)
        if not bounded and max_steps is None:
            raise ValueError("an unbounded stream needs max_steps (batches to train on); or bounded=True")
        self.source, self.decode, self.batch_size = source, decode, batch_size
        self.num_workers, self.bounded, self.max_steps = num_workers, bounded, max_steps
        self.position = Position()
        self.ends: dict[int, int] | None = None
        self.steps = 0  # batches handed out (and restored)

    def _prepare(self) -> tuple[int, int]:
        ctx = current_session().known_context()
        release = getattr(self.source, "release", lambda: None)
        try:
            if getattr(self.source, "partitions", None) is None:
                self.source.partitions = self.source.count()
                assign(self.source.partitions, world=ctx.world_size, rank=ctx.rank, stream=self.source.name)
            if self.bounded and self.ends is None:
                self.ends = self.source.ends(list(range(self.source.partitions)))
        except BaseException:
            release()
            raise
        if self.num_workers:
            release()  # before the fork; without workers the source reads with what it opened
        return ctx.rank, ctx.world_size

    def __iter__(self) -> Iterator[Any]:
        rank, world = self._prepare()
        dataset = _Batches(self.source, rank=rank, world=world, make=self.make, batch_size=self.batch_size,
                           start=Position(self.position.offsets), ends=self.ends if self.bounded else None)
        if self.num_workers:
            chunks = iter(DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                                     persistent_workers=False, multiprocessing_context="fork"))
        else:  # in this process: what a DataLoader without workers does, without its cost per item
            chunks = map(default_convert, dataset)
        try:
            while self.max_steps is None or self.steps < self.max_steps:  # checked before waiting for more
                try:
                    chunk = _unpack(next(chunks))
                except StopIteration:
                    return
                for batch, consumed in chunk:
                    if self.max_steps is not None and self.steps >= self.max_steps:
                        return  # the rest of the chunk is not handed out: the position stays before it
                    self.position.advance(consumed)
                    self.steps += 1
                    yield batch
        finally:
            del chunks  # its workers end with it

    # ---------------------------------------------------------------- ``train.resumable.ResumableStream``

    def set_epoch(self, epoch: int) -> None:
        """A stream has no epochs: it goes on from its position whatever the epoch."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: plain values (``TrainState`` stores them with the checkpoint)."""
        return {"stream": self.source.name, "world": current_session().known_context().world_size,
                "offsets": self.position.to_state(), "steps": self.steps,
                "ends": self.ends and {str(p): o for p, o in self.ends.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state``. Raises ``ValueError`` naming what differs when it is another
        stream's or another world size's (its partitions would belong to other ranks)."""
        world = current_session().known_context().world_size
        if state.get("stream", self.source.name) != self.source.name or state.get("world", world) != world:
            raise ValueError(f"the checkpoint's stream position is of {state.get('stream')!r} over "
                             f"{state.get('world')} rank(s); this loader reads {self.source.name} over {world}")
        self.position = Position.from_state(state.get("offsets"))
        self.steps = int(state.get("steps", 0))
        if state.get("ends"):
            self.ends = {int(p): int(o) for p, o in state["ends"].items()}


def kafka_loader(topic: str, *, bootstrap: str, decode: Decode | None = None, batch_size: int, num_workers: int = 0,
                 bounded: bool = True, max_steps: int | None = None, options: dict[str, Any] | None = None,
                 decode_batch: DecodeBatch | None = None) -> StreamLoader:
    """Batches of a Kafka topic for this rank (see the module docstring). ``options``: more
    librdkafka consumer settings (security, fetch sizes)."""
    return StreamLoader(KafkaSource(topic, bootstrap, options), decode=decode, batch_size=batch_size,
                        num_workers=num_workers, bounded=bounded, max_steps=max_steps, decode_batch=decode_batch)


def rabbitmq_stream_loader(streams: str | list[str], *, url: str, decode: Decode | None = None, batch_size: int,
                           max_steps: int, num_workers: int = 0, decode_batch: DecodeBatch | None = None) -> StreamLoader:
    """Batches of RabbitMQ streams (each one partition) for this rank, read unbounded until
    ``max_steps`` batches (see the module docstring)."""
    names = [streams] if isinstance(streams, str) else list(streams)
    return StreamLoader(RabbitStreamSource(names, url), decode=decode, batch_size=batch_size,
                        num_workers=num_workers, bounded=False, max_steps=max_steps, decode_batch=decode_batch)


__all__ = ["StreamLoader", "kafka_loader", "rabbitmq_stream_loader", "KafkaSource", "RabbitStreamSource"]
