"""The brokers events go to: each sink publishes a batch and says how much of it was confirmed.

Contract of a sink (``Sink``): ``publish(events)`` blocks until the broker confirmed the
events or gave up, and returns how many of them, from the first, are confirmed (``n`` means
``events[:n]`` are safe with the broker); it raises ``SinkUnavailable`` (naming the broker) when
it cannot reach the broker at all, and then reconnects on its next call. ``close()`` is
idempotent. A sink is used by one thread (its relay's).

- ``AmqpSink``: RabbitMQ over AMQP 0-9-1 with pika's blocking connection: a durable topic
  exchange, persistent messages (delivery mode 2), publisher confirms for the whole batch
  (``_BatchConfirms``); ``message_id`` and the ``seq`` and ``kind`` headers carry the seq. The
  frames are encoded by ``amqp_frames`` (pika's bytes, without its per-frame cost) and sent
  ``FLUSH`` messages at a time as the batch is encoded.
- ``KafkaSink``: confluent-kafka's producer, idempotent (``enable.idempotence``: no duplicates
  or reordering from its own retries), ``acks=all``, key = job id (node name for node events:
  a subject's events stay in one partition, in order); ``publish`` flushes and counts the delivery
  reports; a batch none of which was delivered within ``timeout_s`` (``message.timeout.ms``)
  raises ``SinkUnavailable`` and the producer is replaced (its queue purged) on the next call.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from torchrelay.server.events.amqp_frames import publish_frames, publish_method
from torchrelay.server.events.model import Event
from torchrelay.server.events.urls import SinkUrl

log = logging.getLogger(__name__)
FLUSH = 50  # AMQP messages sent to the broker at a time within a batch (it stores them while we encode on)
# pika logs every failed connection attempt at ERROR with a traceback; the relay reports the
# broker's state itself (once, then once a minute), so pika's own reports would only flood the log
logging.getLogger("pika").setLevel(logging.CRITICAL)


class SinkUnavailable(Exception):
    """The broker cannot be reached or refused the connection; the message names it."""


class Sink(Protocol):
    url: SinkUrl

    def publish(self, events: Sequence[Event]) -> int: ...

    def close(self) -> None: ...


class AmqpSink:
    def __init__(self, url: SinkUrl, timeout_s: float = 5.0):
        self.url = url
        self.timeout_s = timeout_s
        self._connection = None
        self._channel = None
        self._confirms: _BatchConfirms | None = None

    def _connect(self) -> None:
        import pika  # local: only servers with an amqp:// sink need it

        params = pika.URLParameters(self.url.target)
        if "heartbeat=" not in self.url.target:
            # a blocking connection waits for a broker's reply with no deadline of its own (a
            # broker still booting may accept a connection and say nothing): heartbeats close
            # such a connection after about two intervals, and the relay then retries
            params.heartbeat = max(2, int(self.timeout_s))
        params.socket_timeout = self.timeout_s
        params.stack_timeout = self.timeout_s * 2
        params.blocked_connection_timeout = self.timeout_s  # a broker out of memory must not hang us
        params.connection_attempts = 1
        try:
            self._connection = pika.BlockingConnection(params)
            self._channel = self._connection.channel()
            self._channel.exchange_declare(self.url.name, exchange_type="topic", durable=True)
            self._confirms = _BatchConfirms(self._connection, self._channel, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - pika raises many kinds; all mean "not now"
            self.close()
            raise SinkUnavailable(f"RabbitMQ at {self.url.redacted}: {type(exc).__name__}: {exc}") from None

    def publish(self, events: Sequence[Event]) -> int:
        if self._channel is None:
            self._connect()
        try:
            return self._confirms.publish(self.url.name, events)
        except Exception as exc:  # noqa: BLE001 - a lost connection, a blocked or silent broker
            self.close()
            raise SinkUnavailable(f"RabbitMQ at {self.url.redacted}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        connection, self._connection, self._channel, self._confirms = self._connection, None, None, None
        if connection is not None:
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail; it is gone either way
                pass


class _BatchConfirms:
    """Publisher confirms for a whole batch at once. pika's blocking channel offers confirms
    only per message (each ``basic_publish`` waits for its own ack: about 100 events/s here,
    one broker sync each); the asynchronous channel under it (``_impl``, the one pika's
    blocking adapter itself drives) takes a callback for acks, which RabbitMQ sends with
    ``multiple`` for many messages at once. So a batch is written without waiting, and the
    connection is pumped until every delivery tag is acked, nacked, or ``timeout_s`` passed."""

    def __init__(self, connection, channel, timeout_s: float):  # noqa: ANN001 - pika's blocking types
        self.connection, self.impl, self.timeout_s = connection, channel._impl, timeout_s
        self.sent = 0  # delivery tags handed out on this channel (they start at 1)
        self.methods: dict[str, bytes] = {}  # routing key -> its basic.publish frame
        self.acked = 0  # every tag up to this one is acked
        self.nacked: set[int] = set()
        self.outcome: dict[int, bool] = {}
        selected: list[bool] = []
        self.impl.confirm_delivery(self._on_confirm, callback=lambda _frame: selected.append(True))
        self._pump(lambda: bool(selected))

    def _on_confirm(self, frame) -> None:  # noqa: ANN001 - a pika method frame
        method = frame.method
        ok = type(method).__name__ == "Ack"
        tags = range(self.acked + 1, method.delivery_tag + 1) if method.multiple else [method.delivery_tag]
        for tag in tags:
            self.outcome.setdefault(tag, ok)
        while self.outcome.get(self.acked + 1):
            self.acked += 1
            del self.outcome[self.acked]

    def _pump(self, done) -> None:  # noqa: ANN001
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no confirm from the broker within {self.timeout_s:g} s")
            self.connection.process_data_events(time_limit=0.05)

    def publish(self, exchange: str, events: Sequence[Event]) -> int:
        """Write the events' frames (``amqp_frames``) straight to the connection's buffer,
        ``FLUSH`` messages at a time, each lot sent as it is made (the broker stores it while
        the next is encoded); then wait for the confirms of all of them."""
        connection, channel = self.impl.connection, self.impl.channel_number
        body_max = connection._body_max_length  # noqa: SLF001 - the frame size pika negotiated
        first, lot = self.sent + 1, []
        for event in events:
            key = event.routing_key()
            method = self.methods.get(key)
            if method is None:
                if len(self.methods) > 10_000:
                    self.methods.clear()
                method = self.methods[key] = publish_method(channel, exchange, key)
            lot.append(publish_frames(channel, method, event.body(), message_id=f"{event.kind}-{event.seq}",
                                      seq=event.seq, kind=event.kind, body_max=body_max))
            self.sent += 1
            if len(lot) == FLUSH:
                self._send(connection, lot)
                lot = []
        if lot:
            self._send(connection, lot)
        last = self.sent
        self._pump(lambda: self.acked >= last or any(t >= first and not ok for t, ok in self.outcome.items()))
        return max(0, self.acked - first + 1)  # confirmed in order from the batch's first

    def _send(self, connection, lot: list[bytes]) -> None:  # noqa: ANN001 - pika's Connection
        if connection.is_closed or not self.impl.is_open:  # e.g. closed by the broker while we sent
            raise ConnectionError(f"the connection or channel {self.impl.channel_number} is closed")
        connection._output_marshaled_frames([b"".join(lot)])  # noqa: SLF001 - what basic_publish ends in
        self.connection.process_data_events(time_limit=0)  # out now; take in the confirms so far


class KafkaSink:
    # 5 s, as the AMQP sink's: a batch a broker has not confirmed by then goes back to the store
    # (the relay resends it from its cursor), rather than holding the relay behind librdkafka's queue
    def __init__(self, url: SinkUrl, timeout_s: float = 5.0):
        self.url = url
        self.timeout_s = timeout_s
        self._producer = None

    def publish(self, events: Sequence[Event]) -> int:
        from confluent_kafka import Producer  # local: only servers with a kafka:// sink need it

        if self._producer is None:
            self._producer = Producer({"bootstrap.servers": self.url.target, "enable.idempotence": True,
                                       "acks": "all", "linger.ms": 2,
                                       "message.timeout.ms": int(self.timeout_s * 1000),
                                       "logger": log})
        delivered: dict[int, bool] = {}

        def reporter(seq: int):  # a delivery report carries no headers: each message its own callback
            return lambda err, _msg: delivered.__setitem__(seq, err is None)

        for event in events:
            self._producer.produce(self.url.name, key=event.key().encode(), value=event.body(),
                                   headers=[("seq", str(event.seq).encode()), ("kind", event.kind.encode())],
                                   on_delivery=reporter(event.seq))
        self._producer.flush(self.timeout_s + 2)
        done = 0
        for event in events:
            if not delivered.get(event.seq):
                break
            done += 1
        if done == 0 and events:
            self.close()  # a fresh producer next time: nothing of this batch lingers in its queue
            raise SinkUnavailable(f"Kafka at {self.url.redacted}: none of {len(events)} events delivered "
                                  f"within {self.timeout_s:g} s")
        return done

    def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.purge()
            producer.flush(0)


def make_sink(url: SinkUrl) -> Sink:
    return KafkaSink(url) if url.kind == "kafka" else AmqpSink(url)
