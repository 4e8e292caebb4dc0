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
- ``address`` may name several servers of one cluster, comma-separated
  (``torchrelay.servers``): a call that gets no answer moves the link to the next server, and
  one that reaches a follower (503 naming the leader) moves it to the leader; that call still
  raises ``ServerUnreachable``, and the agent's own retry goes to the new server. Launches are
  never touched by any of this: they run on while the agent looks for a leader. A server of
  another cluster than the first one that answered (another database) is refused:
  ``ServerRefused`` (409) naming both.
- An ``https://`` server's certificate is verified against ``RELAY_CA`` (``relay agent --ca``),
  else the system's CAs; a TLS failure is a ``ServerUnreachable`` whose message says so
  (``torchrelay.tls``).
- Credentials: every call carries the node's own credential (kept in ``credential_file``, mode
  0600, so a restarted agent reuses it), else the enrolment token (``enroll_token``). A
  registration's reply that carries a new credential replaces the kept one. A registration
  refused (401) with a kept credential the server no longer accepts (its state was lost, or an
  admin revoked it) is tried again once with the enrolment token; a heartbeat refused with 401
  raises ``NodeUnknown`` so that the agent registers again.
- ``close()`` ends the connections, a long poll in flight included (it raises
  ``ServerUnreachable`` in its caller's thread). Idempotent.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import os
from pathlib import Path

import httpx
from pydantic import BaseModel

from torchrelay import tls, wire
from torchrelay.agent.outbox import EntryKind
from torchrelay.servers import ClusterMismatch, ServerList, parse_addresses


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

    def __init__(self, address: str, *, long_poll_s: float, timeout_s: float = 10.0, bundle_timeout_s: float = 300.0,
                 enroll_token: str | None = None, credential_file: Path | None = None):
        self.servers = ServerList(parse_addresses(address))
        base = self.servers.current + wire.API_PREFIX
        self.bundle_timeout_s = bundle_timeout_s
        verify = tls.verify_for(address)  # RELAY_CA (relay agent --ca), else the system's CAs
        self._http = httpx.Client(base_url=base, timeout=timeout_s, verify=verify)
        self._poll_http = httpx.Client(base_url=base, timeout=long_poll_s + 15.0, verify=verify)
        self._enroll_token = enroll_token
        self._credential_file = credential_file
        self._credential: str | None = None
        if credential_file is not None:
            try:
                self._credential = credential_file.read_text().strip() or None
            except OSError:
                pass
        self._send(self._credential or enroll_token)

    def _send(self, token: str | None) -> None:
        for client in (self._http, self._poll_http):
            if token:
                client.headers["authorization"] = f"Bearer {token}"
            else:
                client.headers.pop("authorization", None)

    def _keep(self, credential: str | None) -> None:
        self._credential = credential
        if self._credential_file is not None:
            self._credential_file.unlink(missing_ok=True)
            if credential:
                self._credential_file.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self._credential_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as out:
                    out.write(credential)
        self._send(credential or self._enroll_token)

    def _move(self, failed: str, leader: str | None, why: str) -> None:
        now = self.servers.moved(failed, leader)
        if now != failed:
            self._http.base_url = self._poll_http.base_url = now + wire.API_PREFIX
        raise ServerUnreachable(f"{why}; next: {now}")

    def _call(self, client: httpx.Client, method: str, path: str, **kw) -> httpx.Response:
        tried = self.servers.current
        try:
            reply = client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            self._move(tried, None, f"{method} {path} at {tried}: {tls.tls_failure(exc, tried) or exc}")
        except RuntimeError as exc:  # a client closed under the call ("Cannot send a request...")
            raise ServerUnreachable(f"{method} {path}: {exc}") from exc
        try:
            self.servers.seen(tried, reply.headers.get("x-relay-cluster"))
        except ClusterMismatch as exc:
            raise ServerRefused(409, str(exc)) from None
        leader = reply.headers.get("x-relay-leader") if reply.status_code == 503 else None
        if leader and leader.rstrip("/") != tried:
            self._move(tried, leader, f"{tried} follows; the leader is {leader}")
        return reply

    def _post(self, client: httpx.Client, path: str, body: BaseModel) -> httpx.Response:
        return self._call(client, "POST", path, json=body.model_dump(mode="json"))

    def register(self, registration: wire.NodeRegistration) -> wire.RegisterReply:
        reply = self._post(self._http, "/nodes/register", registration)
        if reply.status_code == 401 and self._credential and self._enroll_token:
            self._keep(None)  # the server no longer takes it: enrol again
            reply = self._post(self._http, "/nodes/register", registration.model_copy(update={"node_id": None}))
        registered = wire.RegisterReply.model_validate(_checked(reply).json())
        if registered.credential:
            self._keep(registered.credential)
        return registered

    def heartbeat(self, node_id: str, beat: wire.Heartbeat) -> wire.HeartbeatReply:
        client = self._poll_http if beat.wait_s > 0 else self._http
        reply = self._post(client, f"/nodes/{node_id}/heartbeat", beat)
        if reply.status_code in (401, 404):
            raise NodeUnknown(reply.status_code, reply.text[:200])
        return wire.HeartbeatReply.model_validate(_checked(reply).json())

    def post_records(self, kind: EntryKind, job_id: str, launch_id: str, records: Sequence) -> None:
        """Post one batch of a launch's log records (``EntryKind.LOGS``) or metric records."""
        batch_type = wire.LogBatch if kind is EntryKind.LOGS else wire.MetricBatch
        body = batch_type(launch_id=launch_id, records=list(records))
        _checked(self._post(self._http, f"/jobs/{job_id}/{kind.value}", body))

    def fetch_bundle(self, digest: str) -> bytes:
        return _checked(self._call(self._http, "GET", f"/bundles/{digest}", timeout=self.bundle_timeout_s)).content

    def close(self) -> None:
        self._http.close()
        self._poll_http.close()
