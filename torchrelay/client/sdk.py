"""Python SDK: every call of the HTTP API, used by the ``relay`` CLI and by users' code.

Contract: the server address comes from the argument, else ``RELAY_ADDRESS``, else the
running embedded cluster's ``<RELAY_HOME>/server.json``. Errors come back as the classes of
``torchrelay.errors`` (``NotFound``, ``InvalidSpec``…); no server answering raises
``ServerUnavailable`` saying where it looked, where the address came from (and, when
``RELAY_ADDRESS`` and the server ``RELAY_HOME`` records disagree, both) and how to start one.
Methods block for at most their ``wait``/``timeout`` arguments plus one HTTP round trip per
server tried. Every call carries the token ``credentials.token_for`` finds for the address
(``RELAY_TOKEN``, the embedded cluster's own, or what ``relay login`` stored), unless one is
given (``token=``); a missing or refused one raises ``Unauthenticated``. The address may name several servers of one cluster, comma-separated: a call
that finds no answer tries the next, and one that reaches a follower goes to the leader it
names (``torchrelay.servers``); ``address`` is the one in use. An ``https://`` server's
certificate is verified against ``ca`` (else ``RELAY_CA``, else the system's CAs); when it does
not verify, or the peer does not speak TLS, calls raise ``UntrustedServer`` naming the address
and ``--ca``/``RELAY_CA`` (``torchrelay.tls``).
"""
from __future__ import annotations

import getpass
import os
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from torchrelay import tls
from torchrelay.client.address import AddressSource, unreachable_message
from torchrelay.client.bundle import pack_dir
from torchrelay.paths import safe_relative_path
from torchrelay.client.credentials import token_for
from torchrelay.client.replies import raise_for_error
from torchrelay.client.streams import follow_stream
from torchrelay.errors import Conflict, RelayError, ServerUnavailable
from torchrelay.home import read_json, relay_home, server_file
from torchrelay.servers import ClusterMismatch, ServerList, parse_addresses
from torchrelay.spec import JobSpec
from torchrelay.wire import (API_PREFIX, ArtifactInfo, BundleRef, EventRecord, JobInfo, LogLine, LogPage, MetricPage,
                             MetricPoint, NodeInfo, SeriesPage, SubmitRequest)


LEADER_WAIT_S = 15.0  # how long a call waits for a leader while a takeover is under way


def recorded_address() -> str | None:
    """The address of the server that ``RELAY_HOME`` records (``server.json``), if any."""
    info = read_json(server_file(relay_home()))
    return info.get("address") if info else None


def resolve_address(address: str | None = None) -> tuple[str, AddressSource] | None:
    """The server URL to use and where it came from, or None when nothing names one."""
    if address:
        return address.rstrip("/"), AddressSource.ARGUMENT
    if os.environ.get("RELAY_ADDRESS"):
        return os.environ["RELAY_ADDRESS"].rstrip("/"), AddressSource.ENVIRONMENT
    recorded = recorded_address()
    return (recorded, AddressSource.HOME) if recorded else None


class RelayClient:
    """A connection to one torchrelay server. Thread-safe (one httpx client)."""

    def __init__(self, address: str | None = None, *, timeout: float = 30.0, user: str | None = None,
                 ca: str | Path | None = None, token: str | None = None):
        resolved = resolve_address(address)
        if resolved is None:
            raise ServerUnavailable(
                f"no torchrelay server is named: RELAY_ADDRESS is unset and {server_file(relay_home())} "
                "does not exist. Start one with `relay up` (embedded cluster) or `relay server`, "
                "or set RELAY_ADDRESS=http://HOST:PORT")
        named, self._source = resolved
        try:
            self._servers = ServerList(parse_addresses(named))
        except ValueError as exc:
            raise ServerUnavailable(f"{exc} (from {self._source.value})") from None
        # the server knows who submits from the token; a user named here (or RELAY_USER) goes
        # into the spec, which only an admin's token may do for another user
        self._for_user = user or os.environ.get("RELAY_USER")
        self.user = self._for_user or _login_name()
        self.token = token or token_for(named)
        self.ca = ca  # None: RELAY_CA, else the system's CAs (torchrelay.tls)
        self._http = httpx.Client(base_url=self.address + API_PREFIX, timeout=timeout,
                                  headers={"authorization": f"Bearer {self.token}"} if self.token else {},
                                  verify=tls.verify_for(named, ca))

    @property
    def admin(self) -> AdminCalls:
        """Users, tokens and node enrolment tokens."""
        return AdminCalls(self)

    @property
    def address(self) -> str:
        """The server in use (the leader, once one answered)."""
        return self._servers.current

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RelayClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ plumbing

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> httpx.Response:
        extra = {"timeout": timeout} if timeout is not None else {}
        if not self.token:  # a client made before its server first started (and wrote its token)
            self.token = token_for(self._servers.current)
            if self.token:
                self._http.headers["authorization"] = f"Bearer {self.token}"
        patience = time.monotonic() + LEADER_WAIT_S
        tries = len(self._servers.addresses) + 1
        while True:  # each server once (no answer), a leader named, and a takeover's wait
            tries_left = tries = tries - 1
            tried = self.address
            try:
                resp = self._http.request(method, path, **kw, **extra)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                if tries_left > 0 and self._move(tried, None):
                    continue
                raise self._unreachable(exc, tried) from None
            try:
                self._servers.seen(tried, resp.headers.get("x-relay-cluster"))
            except ClusterMismatch as exc:
                raise Conflict(str(exc)) from None
            leader = resp.headers.get("x-relay-leader") if resp.status_code == 503 else None
            if leader and leader.rstrip("/") != tried and tries_left > 0 and self._move(tried, leader):
                continue  # a follower: go to the leader it names
            follower = resp.status_code == 503 and resp.headers.get("x-relay-role") == "follower"
            if follower and time.monotonic() < patience:
                time.sleep(0.25)  # a takeover under way: no leader yet
                continue
            break
        raise_for_error(resp)
        return resp

    def _unreachable(self, exc: httpx.TransportError, tried: str) -> ServerUnavailable:
        """What to raise for a call to ``tried`` that got no answer: ``UntrustedServer`` when TLS
        was the reason, else ``ServerUnavailable`` saying where the address came from."""
        untrusted = tls.tls_failure(exc, tried, self.ca)
        if untrusted is not None:
            return untrusted
        cut_off = isinstance(exc, httpx.RemoteProtocolError)
        return ServerUnavailable(unreachable_message(
            tried, self._source, type(exc).__name__, home=str(relay_home()),
            recorded=recorded_address()) + (tls.plain_to_tls_hint(tried) if cut_off else ""))

    def _move(self, failed: str, leader: str | None) -> bool:
        """Switch to the next server (or ``leader``); False when there is no other to try."""
        now = self._servers.moved(failed, leader)
        if now == failed:
            return False
        self._http.base_url = now + API_PREFIX
        return True
        return resp

    def _get(self, path: str, **kw: Any) -> Any:
        return self._request("GET", path, **kw).json()

    # ------------------------------------------------------------ cluster

    def health(self) -> dict[str, Any]:
        return self._get("/health", timeout=5)

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo.model_validate(x) for x in self._get("/nodes")]

    def wait_for_nodes(self, count: int, timeout: float = 60.0) -> list[NodeInfo]:
        """Block until ``count`` READY nodes are registered. Raises ServerUnavailable on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            nodes = [n for n in self.nodes() if n.state == "READY"]
            if len(nodes) >= count:
                return nodes
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"only {len(nodes)} of {count} agents registered within {timeout:g} s")
            time.sleep(0.1)

    # ------------------------------------------------------------ jobs

    def upload_bundle(self, workdir: str | Path) -> str:
        """Pack and upload ``workdir`` unless the server already has it; returns the digest."""
        blob, digest = pack_dir(workdir)
        try:
            known = self._http.head(f"/bundles/{digest}").status_code == 200
        except httpx.TransportError as exc:
            raise self._unreachable(exc, self.address) from None
        if not known:
            ref = BundleRef.model_validate(self._request("POST", "/bundles", content=blob,
                                                         headers={"content-type": "application/gzip"}).json())
            assert ref.digest == digest, f"server stored bundle as {ref.digest}, expected {digest}"
        return digest

    def submit(self, spec: JobSpec | dict[str, Any], *, base_dir: str | Path = ".", upload: bool = True) -> JobInfo:
        """Submit a job; ``spec.workdir`` (relative to ``base_dir``) is packed and uploaded."""
        spec = spec if isinstance(spec, JobSpec) else JobSpec.parse(spec)
        if self._for_user and spec.user is None:
            spec = spec.model_copy(update={"user": self._for_user})
        bundle = None
        if upload:
            bundle = self.upload_bundle(Path(base_dir) / spec.workdir)
        body = SubmitRequest(spec=spec.to_public(), bundle=bundle)
        # pydantic's own JSON in both directions: no intermediate dicts through the json module
        resp = self._request("POST", "/jobs", content=body.model_dump_json(),
                             headers={"content-type": "application/json"})
        return JobInfo.model_validate_json(resp.content)

    def dryrun(self, spec: JobSpec | dict[str, Any]) -> dict[str, Any]:
        """What the server would do with ``spec``, submitting nothing: ``{"executor", "spec",
        "submission"}`` (e.g. the Slurm batch script). Raises InvalidSpec, Unschedulable."""
        spec = spec if isinstance(spec, JobSpec) else JobSpec.parse(spec)
        body = SubmitRequest(spec=spec.to_public(), bundle=None)
        return self._request("POST", "/jobs/dryrun", content=body.model_dump_json(),
                             headers={"content-type": "application/json"}).json()

    def jobs(self, state: str | None = None, limit: int = 100, *, all_users: bool = False) -> list[JobInfo]:
        """The caller's newest jobs; ``all_users``: everyone's (admins only)."""
        params: dict[str, Any] = {"limit": limit}
        if all_users:
            params["all"] = "true"
        if state:
            params["state"] = state
        return [JobInfo.model_validate(x) for x in self._get("/jobs", params=params)]

    def queue(self) -> list[dict[str, Any]]:
        """Waiting jobs in scheduling order: position, id, reason, estimated_start (epoch s or None)."""
        return self._get("/queue")

    def job(self, job_id: str) -> JobInfo:
        return JobInfo.model_validate(self._get(f"/jobs/{job_id}"))

    def cancel(self, job_id: str, *, checkpoint: bool = True) -> JobInfo:
        """Cancel (idempotent). With ``checkpoint`` the workers get the job's stop grace to commit
        a checkpoint after SIGTERM; without, they are killed at once."""
        return JobInfo.model_validate(self._request(
            "POST", f"/jobs/{job_id}/cancel", params={"checkpoint": str(checkpoint).lower()}).json())

    def wait(self, job_id: str, timeout: float | None = None, poll_s: float = 10.0) -> JobInfo:
        """Block until the job is SUCCEEDED, FAILED or CANCELLED (or ``timeout``); returns its info."""
        deadline = None if timeout is None else time.monotonic() + timeout
        info = self.job(job_id)
        while not info.state.terminal:
            left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            if left <= 0:
                break
            info = JobInfo.model_validate(self._get(
                f"/jobs/{job_id}", params={"wait": left, "known_state": info.state.value}, timeout=left + 30))
        return info

    def logs(self, job_id: str, *, after: int = 0, rank: int | None = None, wait: float = 0) -> LogPage:
        params: dict[str, Any] = {"after": after, "wait": wait}
        if rank is not None:
            params["rank"] = rank
        return LogPage.model_validate(self._get(f"/jobs/{job_id}/logs", params=params, timeout=wait + 30))

    def iter_logs(self, job_id: str, *, rank: int | None = None) -> Iterator[LogLine]:
        """Every log line stored so far, page by page; does not wait for more."""
        after = 0
        while True:
            page = self.logs(job_id, after=after, rank=rank)
            if not page.lines:
                return
            yield from page.lines
            after = page.next_after

    def iter_metrics(self, job_id: str) -> Iterator[MetricPoint]:
        """Every metric point stored so far, page by page; does not wait for more."""
        after = 0
        while True:
            page = self.metrics(job_id, after=after)
            if not page.points:
                return
            yield from page.points
            after = page.next_after

    def follow_logs(self, job_id: str, *, rank: int | None = None, after: int = 0) -> Iterator[LogLine]:
        """Every log line after ``after`` until the job ends, as they come (the server-sent
        event stream; a dropped connection resumes where it broke off)."""
        params = {"rank": rank} if rank is not None else {}
        for _event, lines in follow_stream(self._http, f"/jobs/{job_id}/logs/stream", after=after, params=params):
            yield from (LogLine.model_validate(x) for x in lines)

    def follow_metrics(self, job_id: str, *, after: int = 0) -> Iterator[MetricPoint]:
        """Every metric point after ``after`` until the job ends, as they come (as ``follow_logs``)."""
        for _event, points in follow_stream(self._http, f"/jobs/{job_id}/metrics/stream", after=after):
            yield from (MetricPoint.model_validate(x) for x in points)

    def follow_events(self, job_id: str | None = None, *, after: int = 0) -> Iterator[EventRecord]:
        """A job's events until it ends, or (``job_id`` None) every job's, for ever."""
        path = f"/jobs/{job_id}/events/stream" if job_id else "/events/stream"
        for _event, events in follow_stream(self._http, path, after=after):
            yield from (EventRecord.model_validate(x) for x in events)

    def series(self, job_id: str, *, keys: list[str] | None = None, rank: int | None = None, points: int = 1000,
               start: float | None = None, end: float | None = None) -> SeriesPage:
        """The job's metric series downsampled to ``points`` each (full resolution in a small
        ``start``..``end`` step range)."""
        params: dict[str, Any] = {"points": points}
        for name, value in (("keys", ",".join(keys) if keys else None), ("rank", rank), ("start", start),
                            ("end", end)):
            if value is not None:
                params[name] = value
        return SeriesPage.model_validate_json(self._request("GET", f"/jobs/{job_id}/series", params=params).content)

    def metrics(self, job_id: str, *, after: int = 0, wait: float = 0) -> MetricPage:
        return MetricPage.model_validate(self._get(f"/jobs/{job_id}/metrics", params={"after": after, "wait": wait},
                                                   timeout=wait + 30))

    def write_tensorboard(self, job_id: str) -> list[str]:
        """Have the server write the job's TensorBoard event files from its metrics so far;
        returns their artifact paths (``tensorboard/rank-R/…``)."""
        return self._request("POST", f"/jobs/{job_id}/tensorboard", timeout=300).json()

    def artifacts(self, job_id: str) -> list[ArtifactInfo]:
        return [ArtifactInfo.model_validate(x) for x in self._get(f"/jobs/{job_id}/artifacts")]

    def artifact_bytes(self, job_id: str, path: str) -> bytes:
        """One artifact's bytes. Raises NotFound naming it when the job has no such artifact."""
        return self._request("GET", f"/jobs/{job_id}/artifacts/{path}").content

    def put_artifact(self, job_id: str, path: str, data: bytes) -> ArtifactInfo:
        """Store ``data`` as the job's artifact ``path`` (a worker's ``RELAY_TOKEN`` may, for its own job)."""
        return ArtifactInfo.model_validate(self._request("PUT", f"/jobs/{job_id}/artifacts/{path}", content=data).json())

    def download(self, job_id: str, dest: str | Path, *, prefix: str = "") -> list[Path]:
        """Fetch every artifact of the job (whose path starts with ``prefix``) into ``dest``;
        returns the written paths."""
        dest = Path(dest)
        written = []
        for art in self.artifacts(job_id):
            if not art.path.startswith(prefix):
                continue
            safe_relative_path(art.path)  # what a server lists is checked too: InvalidPath
            target = (dest / art.path).resolve()
            if dest.resolve() not in target.parents:
                raise RelayError(f"artifact path {art.path!r} would leave {dest}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with self._http.stream("GET", f"/jobs/{job_id}/artifacts/{art.path}") as resp:
                raise_for_error(resp)
                tmp = target.with_name(target.name + ".part")
                with open(tmp, "wb") as fh:
                    for chunk in resp.iter_bytes(1 << 20):
                        fh.write(chunk)
                os.replace(tmp, target)
            written.append(target)
        return written


class AdminCalls:
    """Users, tokens and node enrolment (``RelayClient.admin``)."""

    def __init__(self, client: "RelayClient"):
        self._c = client

    def whoami(self) -> dict[str, Any]:
        return self._c._get("/whoami")

    def users(self) -> list[dict[str, Any]]:
        return self._c._get("/users")

    def add_user(self, name: str, role: str = "user") -> dict[str, Any]:
        return self._c._request("POST", "/users", json={"name": name, "role": role}).json()

    def remove_user(self, name: str) -> None:
        self._c._request("DELETE", f"/users/{name}")

    def tokens(self) -> list[dict[str, Any]]:
        return self._c._get("/tokens")

    def create_token(self, user: str | None = None, *, label: str = "",
                     expires_in_s: float | None = None) -> dict[str, Any]:
        """A new token; its text is ``["token"]`` of the reply, shown this once."""
        return self._c._request("POST", "/tokens", json={"user": user, "label": label,
                                                          "expires_in_s": expires_in_s}).json()

    def revoke_token(self, token_id: str) -> None:
        self._c._request("DELETE", f"/tokens/{token_id}")

    def enroll_token(self, *, label: str = "", expires_in_s: float | None = None) -> dict[str, Any]:
        return self._c._request("POST", "/nodes/enroll-tokens", json={"label": label,
                                                                     "expires_in_s": expires_in_s}).json()


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
