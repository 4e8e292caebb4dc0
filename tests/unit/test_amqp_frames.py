"""The event sink's AMQP frames are byte for byte what pika marshals for the same publish."""
from __future__ import annotations

import pytest
from pika import frame, spec

from torchrelay.server.events.amqp_frames import publish_frames, publish_method


def pikas(channel: int, exchange: str, key: str, body: bytes, message_id: str, seq: int, kind: str,
          body_max: int) -> bytes:
    props = spec.BasicProperties(delivery_mode=2, content_type="application/json", message_id=message_id,
                                 headers={"seq": seq, "kind": kind})
    out = [frame.Method(channel, spec.Basic.Publish(exchange=exchange, routing_key=key)).marshal(),
           frame.Header(channel, len(body), props).marshal()]
    out += [frame.Body(channel, body[i:i + body_max]).marshal() for i in range(0, len(body), body_max)]
    return b"".join(out)


@pytest.mark.parametrize("channel, exchange, key, body, message_id, seq, kind, body_max", [
    (1, "relay.events", "job.job-7.state", b'{"seq":1}', "state-1", 1, "state", 131064),
    (2, "x", "node.gpu-07.state", b"{}" * 40, "node-2147483647", 2 ** 31 - 1, "node", 131064),
    (1, "relay.events", "job.j.metrics", b'{"v":1}', "metrics-2147483648", 2 ** 31, "metrics", 131064),
    (1, "relay.events", "job.j.state", bytes(range(256)) * 3, "state-9", 9, "state", 100),  # split bodies
    (7, "", "job.é.state", "é".encode() * 10, "state-5", 5, "checkpoint", 131064),
])
def test_frames_are_pikas(channel, exchange, key, body, message_id, seq, kind, body_max):
    ours = publish_frames(channel, publish_method(channel, exchange, key), body, message_id=message_id,
                          seq=seq, kind=kind, body_max=body_max)
    assert ours == pikas(channel, exchange, key, body, message_id, seq, kind, body_max)


def test_a_routing_key_too_long_is_refused_naming_it():
    with pytest.raises(ValueError, match="routing key 'job.x{300}.state' is 310 bytes"):
        publish_method(1, "relay.events", "job." + "x" * 300 + ".state")
