"""The AMQP 0-9-1 frames of one event's ``basic.publish``, as bytes. Pure.

Contract: ``publish_frames(channel, method, body, *, message_id, seq, kind, body_max)`` is the
method frame (``publish_method(channel, exchange, routing_key)``, which a sink caches per
routing key), the content header frame (``content_type`` ``application/json``, persistent
``delivery_mode`` 2, ``message_id``, headers ``{"seq": seq, "kind": kind}``) and the body in
frames of at most ``body_max`` bytes: byte for byte what pika's own marshaling makes of
``basic_publish(exchange, routing_key, body, BasicProperties(...))`` with those properties
(tests/unit/test_amqp_frames.py compares them), in one buffer.

Why: pika marshals every message through its generic property and table encoders and hands
each of its three frames to its transport separately, one ``send`` system call per frame;
that, not the broker, was most of an event's cost (docs/queues.md, "Performance"). A name or
routing key over 255 bytes raises ``ValueError`` naming it, as pika would refuse it.
"""
from __future__ import annotations

import struct

FRAME_END = b"\xce"
METHOD, HEADER, BODY = 1, 2, 3
BASIC = 60
PUBLISH = 40
CONTENT_TYPE = b"application/json"
# the properties set, in the order AMQP encodes them: content-type, headers, delivery-mode, message-id
FLAGS = (1 << 15) | (1 << 13) | (1 << 12) | (1 << 7)
_FRAME = struct.Struct(">BHI")
_INT32 = (-(2 ** 31), 2 ** 31 - 1)


def _short(value: str | bytes, what: str) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) > 255:
        raise ValueError(f"{what} {value!r} is {len(raw)} bytes; AMQP short strings hold at most 255")
    return bytes((len(raw),)) + raw


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return _FRAME.pack(kind, channel, len(payload)) + payload + FRAME_END


def publish_method(channel: int, exchange: str, routing_key: str) -> bytes:
    """The ``basic.publish`` method frame (ticket 0, not mandatory, not immediate)."""
    payload = struct.pack(">HHH", BASIC, PUBLISH, 0) + _short(exchange, "exchange") \
        + _short(routing_key, "routing key") + b"\x00"
    return _frame(METHOD, channel, payload)


def _int_value(value: int) -> bytes:
    # as pika encodes an int: a signed 32-bit 'I' when it fits, else a signed 64-bit 'l'
    return struct.pack(">ci", b"I", value) if _INT32[0] <= value <= _INT32[1] else struct.pack(">cq", b"l", value)


def publish_frames(channel: int, method: bytes, body: bytes, *, message_id: str, seq: int, kind: str,
                   body_max: int) -> bytes:
    """``method`` (``publish_method``), the content header and the body frames of one message."""
    kind_raw = kind.encode()
    table = _short("seq", "header") + _int_value(seq) + _short("kind", "header") \
        + struct.pack(">cI", b"S", len(kind_raw)) + kind_raw
    header = struct.pack(">HHQH", BASIC, 0, len(body), FLAGS) + _short(CONTENT_TYPE, "content type") \
        + struct.pack(">I", len(table)) + table + b"\x02" + _short(message_id, "message id")
    parts = [method, _frame(HEADER, channel, header)]
    for start in range(0, len(body), body_max):
        parts.append(_frame(BODY, channel, body[start:start + body_max]))
    return b"".join(parts)
