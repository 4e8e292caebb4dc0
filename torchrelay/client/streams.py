"""Following a server-sent event stream of the API, reconnecting where it broke off.

Contract: ``follow_stream(http, path, after=0, params=None)`` yields ``(event, data)`` for every
message of ``path`` (``data`` parsed from JSON), in order, until the server sends
``event: end`` (the job finished; not yielded). A dropped connection (the server restarted, a
proxy cut it) is opened again with ``Last-Event-ID`` set to the last id received, so nothing
is missed and nothing repeated; after ``give_up_s`` without a connection it raises
``ServerUnavailable``; a TLS failure (the certificate does not verify) raises ``UntrustedServer``
at once. HTTP errors raise the class of ``torchrelay.errors`` the server named.
Blocks between messages; ``read_timeout_s`` must exceed the server's keepalive (15 s).

SSE parsing is httpx-sse's.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

import httpx
from httpx_sse import connect_sse

from torchrelay.client.replies import raise_for_error
from torchrelay.errors import ServerUnavailable
from torchrelay.tls import tls_failure
from torchrelay.wire import API_PREFIX

RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.ReadTimeout,
             httpx.RemoteProtocolError)


def follow_stream(http: httpx.Client, path: str, *, after: int = 0, params: dict[str, Any] | None = None,
                  read_timeout_s: float = 45.0, give_up_s: float = 30.0,
                  sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[str, Any]]:
    last = after
    failing_since: float | None = None
    while True:
        try:
            with connect_sse(http, "GET", path, params={**(params or {}), "after": last},
                             headers={"last-event-id": str(last)},
                             timeout=httpx.Timeout(10.0, read=read_timeout_s)) as source:
                raise_for_error(source.response)
                failing_since = None
                for sse in source.iter_sse():
                    if sse.event == "end":
                        return
                    if not sse.data:  # the `retry:` line (browsers do not dispatch it either)
                        continue
                    if sse.id:
                        last = int(sse.id)
                    yield sse.event, json.loads(sse.data)
        except RETRYABLE as exc:
            untrusted = tls_failure(exc, str(http.base_url).rstrip("/").removesuffix(API_PREFIX))
            if untrusted is not None:  # a certificate does not verify again by waiting
                raise untrusted from None
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since > give_up_s:
                raise ServerUnavailable(f"the stream {path} broke off ({type(exc).__name__}) and could not be "
                                        f"opened again for {give_up_s:g} s") from None
        sleep(0.5)  # the server ended the stream early or it broke: resume after `last`
