"""Request bodies the server takes and files it serves: size limits, streaming, never whole in memory.

- ``UploadLimits`` (``torchrelay.server.config``, its ``limits`` section): the most bytes one
  bundle, artifact, log batch and metric batch may have, and any other request body.
- ``BodyLimits(app, limits)``: ASGI middleware. A body over its route's limit is answered
  ``413`` (``PayloadTooLarge``, naming the limit and the setting that raises it): at once when
  its ``Content-Length`` says so, else as soon as the bytes received pass it. The rest of an
  over-limit body is read and dropped (up to ``DRAIN_BYTES``) so that the client, still
  sending, gets the answer rather than a reset connection.
- ``spooled(request)``: an async context manager that streams the body to a temporary file,
  hashing as it goes, and yields ``Spooled(path, size, sha256)``; the file is removed after.
  Memory stays at one chunk whatever the body's size. Temporary files go to ``TMPDIR``.
- ``stored_file(store, key, media_type)``: a streamed response of a store file (``NotFound``
  before any byte is sent when it is missing).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import tempfile
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from torchrelay.errors import PayloadTooLarge
from torchrelay.server.config import GiB, MiB, UploadLimits
from torchrelay.storage import ArtifactStore
from torchrelay.wire import API_PREFIX

CHUNK_BYTES = 1 << 20
DRAIN_BYTES = 64 * MiB  # past this much more, an over-limit body is cut off (connection closed)


_ROUTES = (("POST", re.compile(rf"^{API_PREFIX}/bundles/?$"), "bundle"),
           ("PUT", re.compile(rf"^{API_PREFIX}/jobs/[^/]+/artifacts/.+$"), "artifact"),
           ("POST", re.compile(rf"^{API_PREFIX}/jobs/[^/]+/logs/?$"), "log_batch"),
           ("POST", re.compile(rf"^{API_PREFIX}/jobs/[^/]+/metrics/?$"), "metric_batch"))


_WITH_BODY = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def limit_for(method: str, path: str) -> str | None:
    """The ``UploadLimits`` field that bounds a ``method`` request to ``path``: the route's own,
    else ``request`` for any method that may carry a body; None: a GET, HEAD or OPTIONS."""
    for want, pattern, name in _ROUTES:
        if method == want and pattern.match(path):
            return name
    return "request" if method in _WITH_BODY else None


def too_large_message(name: str, limit: int, size: int | None) -> str:
    what = name.replace("_", " ")
    said = f"of {_human(size)} " if size is not None else ""
    return (f"the {what} {said}is over the server's limit of {_human(limit)} ({limit} bytes); "
            f"the limits.{name} setting of the server config (relay server --config FILE) raises it")


def _human(size: int) -> str:
    for unit, factor in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if size >= factor:
            return f"{size / factor:.4g} {unit}"
    return f"{size} bytes"


class BodyLimits:
    """ASGI middleware answering 413 to bodies over their route's limit (see the module docstring)."""

    def __init__(self, app: Any, limits: UploadLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        name = limit_for(scope.get("method", ""), scope.get("path", "")) if scope["type"] == "http" else None
        if name is None:
            return await self.app(scope, receive, send)
        limit = getattr(self.limits, name)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _drain(receive, 0)
            return await _answer_413(send, too_large_message(name, limit, declared))
        state = {"seen": 0, "over": False, "started": False, "done": False}

        async def counted() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                state["seen"] += len(message.get("body", b""))
                state["done"] = not message.get("more_body", False)
                if state["seen"] > limit:
                    state["over"] = True
                    raise PayloadTooLarge(too_large_message(name, limit, None))
            return message

        async def guarded(message: dict) -> None:
            if state["over"]:
                return  # the app's own answer to the cut-off body: ours goes instead
            state["started"] = True
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not state["over"]:
                raise
        if state["over"] and not state["started"]:
            if not state["done"]:
                await _drain(receive, state["seen"])
            await _answer_413(send, too_large_message(name, limit, None))


def _content_length(scope: dict) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Callable[[], Awaitable[dict]], seen: int) -> None:
    """Read and drop what is left of the body, up to ``DRAIN_BYTES`` more."""
    dropped = 0
    while dropped < DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _answer_413(send: Callable[[dict], Awaitable[None]], detail: str) -> None:
    body = json.dumps({"error": "PayloadTooLarge", "detail": detail}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


@dataclasses.dataclass(frozen=True, slots=True)
class Spooled:
    path: str
    size: int
    sha256: str


@contextlib.asynccontextmanager
async def spooled(request: Request) -> AsyncIterator[Spooled]:
    """The request's body in a temporary file (see the module docstring)."""
    fd, path = tempfile.mkstemp(prefix="relay-upload-")
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in request.stream():
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        yield Spooled(path, size, digest.hexdigest())
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def stored_file(store: ArtifactStore, key: str, media_type: str = "application/octet-stream") -> StreamingResponse:
    """The store file ``key`` as a streamed response. Blocks for a lookup; raises ``NotFound``."""
    size = store.size(key)

    def chunks() -> Iterator[bytes]:
        with store.open_read(key) as fh:
            while chunk := fh.read(CHUNK_BYTES):
                yield chunk

    return StreamingResponse(chunks(), media_type=media_type, headers={"content-length": str(size)})
