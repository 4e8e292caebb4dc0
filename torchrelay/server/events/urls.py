"""``--events`` URLs: which sink, where, and what it publishes to. Pure.

- ``amqp://USER:PASS@HOST:PORT/VHOST?exchange=NAME`` (also ``amqps://``): RabbitMQ over AMQP
  0-9-1; events go to the topic exchange ``NAME`` (default ``relay.events``); the rest of the
  URL is pika's (``heartbeat=``, ``connection_attempts=`` …).
- ``kafka://HOST:PORT[,HOST:PORT…]/TOPIC``: Kafka; events go to ``TOPIC`` (default
  ``relay.events``), keyed by job id.
``parse_sink_url`` raises ``InvalidSpec`` naming the URL and what is wrong; ``redacted`` is
the URL without its password, for logs and cursor names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from torchrelay.errors import InvalidSpec

DEFAULT_NAME = "relay.events"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")  # Kafka's topic rule, also fine for an exchange
_SCHEMES = ("amqp", "amqps", "kafka")


@dataclass(frozen=True, slots=True)
class SinkUrl:
    kind: str  # "amqp" or "kafka"
    target: str  # pika's URL (without ``exchange``) or Kafka's bootstrap servers
    name: str  # the exchange or the topic
    redacted: str  # the URL without a password


def parse_sink_url(text: str) -> SinkUrl:
    bad = f"--events {text!r}"
    try:
        parts = urlsplit(text)
        port = parts.port if parts.scheme != "kafka" else None  # a Kafka URL may list several HOST:PORT
    except ValueError as exc:
        raise InvalidSpec(f"{bad} is not a URL: {exc}") from None
    if parts.scheme not in _SCHEMES:
        raise InvalidSpec(f"{bad}: scheme {parts.scheme!r} is not one of {', '.join(_SCHEMES)}; e.g. "
                          "amqp://guest:guest@127.0.0.1:5672/%2F or kafka://127.0.0.1:9092/relay.events")
    if not parts.hostname or parts.hostname.startswith(","):
        raise InvalidSpec(f"{bad} names no host")
    shown = parts.netloc.replace(f":{parts.password}@", ":***@") if parts.password else parts.netloc
    redacted = urlunsplit((parts.scheme, shown, parts.path, parts.query, ""))
    if parts.scheme == "kafka":
        name = parts.path.strip("/") or DEFAULT_NAME
        if parts.query or "/" in name:
            raise InvalidSpec(f"{bad}: a Kafka URL is kafka://HOST:PORT[,HOST:PORT]/TOPIC, nothing after the topic")
        hosts = parts.netloc.split(",")
        if any(not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:\d{1,5}", h) for h in hosts):
            raise InvalidSpec(f"{bad}: every Kafka bootstrap server needs HOST:PORT (got {parts.netloc!r})")
        _check_name(bad, name)
        return SinkUrl("kafka", parts.netloc, name, redacted)
    if port is None:
        raise InvalidSpec(f"{bad} names no port; RabbitMQ's AMQP port is usually 5672")
    query = parse_qsl(parts.query, keep_blank_values=True)
    name = dict(query).get("exchange", DEFAULT_NAME)
    _check_name(bad, name)
    rest = urlencode([(k, v) for k, v in query if k != "exchange"])
    return SinkUrl("amqp", urlunsplit((parts.scheme, parts.netloc, parts.path or "/", rest, "")), name, redacted)


def _check_name(bad: str, name: str) -> None:
    if not _NAME.match(name):
        raise InvalidSpec(f"{bad}: {name!r} is not a usable exchange or topic name (letters, digits, '.', '_', '-')")
