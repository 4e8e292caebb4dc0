"""The agent's calls to the server (``/api/v1``), and what their failures mean to the agent.

Contract:
- ``ServerLink`` is what the agent needs of a server; ``HttpServerLink(address, long_poll_s)``
  is the real one over HTTP (httpx). Tests give the agent a fake with the same methods.
- ``register(registration)`` (``POST /nodes/register``), ``heartbeat(node_id, beat)``
  (``POST /nodes/{id}/heartbeat``; a long poll when ``beat.wait_s > 0``, on a connection of its
  own so that the other calls never wait behind it), ``post_records(kind, job, launch, records)`` (a log or
  metric batch: ``POST /jobs/{job}/logs`` or ``/metrics``) and ``fetch_bundle(digest)`` (``GET /bundles/{digest}``).
- Each raises ``ServerUnreachable`` when no answer came (connection refused or broken, timeout),
  ``ServerRefused`` (with the status code) when the server answered with an error, and
  ``NodeUnknown`` (a ``ServerRefused``) when a heartbeat names a node the server does not know.
- ``close()`` ends the connections, a long poll in flight included (it raises
  ``ServerUnreachable`` in its caller's thread). Idempotent.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import httpx
from pydantic import BaseModel

from torchrelay import wire
from torchrelay.agent.outbox import EntryKind


class ServerUnreachable(ConnectionError):
    """No answer from the server; what was being sent may be sent again later."""


class ServerRefused(RuntimeError):
    """The server answered with an error status (``status_code``)."""

    def __init__(self, status_code: int, detail: str):
        super().__init__(f"{status_code} {detail}")
        self.status_code = status_code


class NodeUnknown(ServerRefused):
    """The server does not know this node (it lost its state): register again."""


class ServerLink(Protocol):
    def register(self, registration: wire.NodeRegistration) -> wire.RegisterReply: ...

    def heartbeat(self, node_id: str, beat: wire.Heartbeat) -> wire.HeartbeatReply: ...

    def post_records(self, kind: EntryKind, job_id: str, launch_id: str, records: Sequence) -> None: ...

    def fetch_bundle(self, digest: str) -> bytes: ...

    def close(self) -> None: ...


def _checked(reply: httpx.Response) -> httpx.Response:
    if reply.status_code >= 400:
        raise ServerRefused(reply.status_code, reply.text[:200])
    return reply


class HttpServerLink:
    """``ServerLink`` over HTTP. Thread-safe (httpx clients are)."""

    def __init__(self, address: str, *, long_poll_s: float, timeout_s: float = 10.0, bundle_timeout_s: float = 300.0):
        base = address.rstrip("/") + wire.API_PREFIX
        self.bundle_timeout_s = bundle_timeout_s
        self._http = httpx.Client(base_url=base, timeout=timeout_s)
        self._poll_http = httpx.Client(base_url=base, timeout=long_poll_s + 15.0)

    def _post(self, client: httpx.Client, path: str, body: BaseModel) -> httpx.Response:
        try:
            return client.post(path, json=body.model_dump(mode="json"))
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"POST {path}: {exc}") from exc
        except RuntimeError as exc:  # a client closed under the call ("Cannot send a request...")
            raise ServerUnreachable(f"POST {path}: {exc}") from exc

    def register(self, registration: wire.NodeRegistration) -> wire.RegisterReply:
        reply = _checked(self._post(self._http, "/nodes/register", registration))
        return wire.RegisterReply.model_validate(reply.json())

    def heartbeat(self, node_id: str, beat: wire.Heartbeat) -> wire.HeartbeatReply:
        client = self._poll_http if beat.wait_s > 0 else self._http
        reply = self._post(client, f"/nodes/{node_id}/heartbeat", beat)
        if reply.status_code == 404:
            raise NodeUnknown(404, reply.text[:200])
        return wire.HeartbeatReply.model_validate(_checked(reply).json())

    def post_records(self, kind: EntryKind, job_id: str, launch_id: str, records: Sequence) -> None:
        """Post one batch of a launch's log records (``EntryKind.LOGS``) or metric records."""
        batch_type = wire.LogBatch if kind is EntryKind.LOGS else wire.MetricBatch
        body = batch_type(launch_id=launch_id, records=list(records))
        _checked(self._post(self._http, f"/jobs/{job_id}/{kind.value}", body))

    def fetch_bundle(self, digest: str) -> bytes:
        try:
            reply = self._http.get(f"/bundles/{digest}", timeout=self.bundle_timeout_s)
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"GET /bundles/{digest}: {exc}") from exc
        return _checked(reply).content

    def close(self) -> None:
        self._http.close()
        self._poll_http.close()
