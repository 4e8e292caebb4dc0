"""Who may call what: each request's credential, and each route's rule (FastAPI dependency).

Contract:
- ``authorize`` is a dependency of every route of the app (``create_app`` gives it to FastAPI):
  it finds the request's route in ``RULES`` by method and path template (a route not listed
  there is for admins only: a new route is closed until it is given a rule), reads the
  credential (``Authorization: Bearer <token>``, else the dashboard's ``relay_token`` cookie),
  turns it into an ``auth.Principal`` and checks the rule; the principal is left on
  ``request.state.principal``. Raises ``Unauthenticated`` (401: no credential, or one not
  accepted), ``Forbidden`` (403: a kind of credential the route does not take), ``NotFound``
  (404: a job of another user, answered exactly as a job that does not exist, so that ids
  reveal nothing) and ``TooManyAttempts`` (429, instead of 401, for a bad credential from a
  client address that sent too many within the limiter's window; a good credential from that
  address still passes: the address may be a node's, shared by its agent and other users' jobs). Blocking reads run in the thread pool.
- Job-scoped routes (a ``{job_id}`` parameter): a user must own the job (an admin any job); a
  worker's token must be of that job; a node must have run a launch of it.
- ``/nodes/{node_id}/…``: only that node's credential. ``GET /bundles/{digest}``: a node a
  launch of a job with that bundle was placed on, or an admin.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select

from torchrelay.errors import Forbidden, NotFound, TooManyAttempts, Unauthenticated
from torchrelay.server.auth import ENROLL, NODE, USER, WORKER, Credentials, Principal
from torchrelay.server.ratelimit import FailureLimiter
from torchrelay.server.store import JobRow, LaunchRow
from torchrelay.wire import API_PREFIX

PUBLIC, ADMIN, SCRAPER = "public", "admin", "scraper"
COOKIE = "relay_token"


@dataclass(frozen=True, slots=True)
class Rule:
    """The kinds of credential a route takes: ``user`` (any user), ``admin``, ``node``,
    ``worker``, ``enroll``, or ``public`` (none needed)."""

    who: frozenset[str]


def _r(*who: str) -> Rule:
    return Rule(frozenset(who))


_USER_OR_WORKER = _r(USER, WORKER)
RULES: dict[tuple[str, str], Rule] = {
    ("GET", "/api/v1/health"): _r(PUBLIC),
    ("GET", "/"): _r(PUBLIC),  # the dashboard's page shell: its API calls need a token
    # its series name every job and user: an admin's, or a scraper's (a user of role scraper, for Prometheus)
    ("GET", "/metrics"): _r(ADMIN, SCRAPER),
    ("GET", "/api/v1/openapi.json"): _r(USER),
    ("GET", "/api/v1/docs"): _r(USER),
    ("POST", "/api/v1/bundles"): _r(USER),
    ("HEAD", "/api/v1/bundles/{digest}"): _r(USER),
    ("GET", "/api/v1/bundles/{digest}"): _r(NODE, ADMIN),
    ("POST", "/api/v1/jobs"): _r(USER),
    ("POST", "/api/v1/jobs/dryrun"): _r(USER),
    ("GET", "/api/v1/jobs"): _r(USER),
    ("GET", "/api/v1/queue"): _r(USER),
    ("GET", "/api/v1/quotas"): _r(USER),
    ("GET", "/api/v1/nodes"): _r(USER),
    ("GET", "/api/v1/jobs/{job_id}"): _USER_OR_WORKER,
    ("POST", "/api/v1/jobs/{job_id}/cancel"): _r(USER),
    ("GET", "/api/v1/jobs/{job_id}/logs"): _r(USER),
    ("GET", "/api/v1/jobs/{job_id}/metrics"): _USER_OR_WORKER,
    ("GET", "/api/v1/jobs/{job_id}/artifacts"): _USER_OR_WORKER,
    ("GET", "/api/v1/jobs/{job_id}/artifacts/{path}"): _USER_OR_WORKER,
    ("PUT", "/api/v1/jobs/{job_id}/artifacts/{path}"): _USER_OR_WORKER,
    ("GET", "/api/v1/jobs/{job_id}/checkpoints"): _USER_OR_WORKER,
    ("GET", "/api/v1/jobs/{job_id}/checkpoints/{path}"): _USER_OR_WORKER,
    ("GET", "/api/v1/jobs/{job_id}/logs/stream"): _r(USER),
    ("GET", "/api/v1/jobs/{job_id}/metrics/stream"): _r(USER),
    ("GET", "/api/v1/jobs/{job_id}/events/stream"): _r(USER),
    ("GET", "/api/v1/jobs/{job_id}/series"): _r(USER),
    ("POST", "/api/v1/jobs/{job_id}/tensorboard"): _r(USER),
    ("GET", "/api/v1/events/stream"): _r(USER),  # a user's own jobs' events; an admin's: all
    ("POST", "/api/v1/nodes/register"): _r(ENROLL, NODE, ADMIN),
    ("POST", "/api/v1/nodes/{node_id}/heartbeat"): _r(NODE),
    # an admin too: tools that replay or import a job's records
    ("POST", "/api/v1/jobs/{job_id}/logs"): _r(NODE, ADMIN),
    ("POST", "/api/v1/jobs/{job_id}/metrics"): _r(NODE, WORKER, ADMIN),
    # a worker of the job only (its token names the attempt): what its rank 0 committed
    ("POST", "/api/v1/jobs/{job_id}/checkpoints"): _r(WORKER),
    ("GET", "/api/v1/whoami"): _r(USER, NODE, WORKER, ENROLL, SCRAPER),
    ("GET", "/api/v1/users"): _r(ADMIN),
    ("POST", "/api/v1/users"): _r(ADMIN),
    ("DELETE", "/api/v1/users/{name}"): _r(ADMIN),
    ("GET", "/api/v1/tokens"): _r(USER),  # own tokens; an admin's: all
    ("POST", "/api/v1/tokens"): _r(USER),  # for oneself; an admin: for anyone
    ("DELETE", "/api/v1/tokens/{token_id}"): _r(USER),  # own; an admin: any
    ("POST", "/api/v1/nodes/enroll-tokens"): _r(ADMIN),
    ("POST", "/api/v1/session"): _r(USER),
}
_ADMIN_ONLY = _r(ADMIN)


class Guard:
    """What ``authorize`` needs, kept on ``app.state.guard``."""

    def __init__(self, credentials: Credentials, db: Any, limiter: FailureLimiter | None = None):
        self.credentials = credentials
        self.db = db
        self.limiter = limiter or FailureLimiter()
        # facts that never change once true, so a request need not read them again: a job's owner,
        # and that a launch of a job was placed on a node (agents post for their jobs many times)
        self.owners: dict[str, str] = {}
        self.placed: set[tuple[str, str]] = set()
        self.launches: dict[str, tuple[str, int, str]] = {}  # launch id -> (job id, attempt, node id)

    def known_allowed(self, who: Principal, job_id: str) -> bool:
        """Whether what was read before already allows ``who`` on ``job_id`` (no I/O)."""
        if who.kind == USER:
            return who.admin and job_id in self.owners or self.owners.get(job_id) == who.name
        if who.kind == WORKER:
            return who.job_id == job_id
        return who.kind == NODE and (job_id, who.node_id) in self.placed

    def remember(self, job_id: str, owner: str, node_id: str | None = None) -> None:
        if len(self.owners) > 100_000:
            self.owners.clear()
        if len(self.placed) > 100_000:
            self.placed.clear()
        self.owners[job_id] = owner
        if node_id is not None:
            self.placed.add((job_id, node_id))


def rule_of(method: str, path: str) -> Rule:
    """The rule of a route (``path`` its template, ``{name:path}`` written ``{name}``)."""
    return RULES.get((method, path.replace(":path}", "}")), _ADMIN_ONLY)


def token_of(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip() or None
    return request.cookies.get(COOKIE) or None


async def authorize(request: Request) -> None:
    """The dependency; see the module docstring."""
    route = request.scope.get("route")
    method = "GET" if request.method == "HEAD" and route is not None and "HEAD" not in route.methods else request.method
    rule = rule_of(method, route.path if route is not None else request.url.path)
    if PUBLIC in rule.who:
        return
    guard: Guard = request.app.state.guard
    principal = await _principal(guard, request)
    request.state.principal = principal
    _check_kind(rule, principal, method, route.path if route is not None else request.url.path)
    params = request.path_params
    if "job_id" in params and not guard.known_allowed(principal, params["job_id"]):
        await run_in_threadpool(_check_job, guard, principal, params["job_id"])
    if "node_id" in params and principal.node_id != params["node_id"]:
        raise Forbidden(f"this node's credential is for node {principal.node_id}, not {params['node_id']}")
    if "digest" in params and method == "GET" and principal.kind == NODE:
        await run_in_threadpool(_check_bundle, guard, principal, params["digest"])


async def _principal(guard: Guard, request: Request) -> Principal:
    text = token_of(request)
    if text is None:
        raise Unauthenticated("a token is needed: `relay login` stores one (or set RELAY_TOKEN; HTTP: "
                              "Authorization: Bearer <token>)")
    addr = request.client.host if request.client else "?"
    # a good credential always passes: a blocked address shares its host with agents and other
    # users' workers, which one process sending bad tokens must not lock out
    cached = guard.credentials.cached_principal(text)  # on the loop: a thread hop costs more than the check
    if cached is not None:
        return cached
    try:
        return await run_in_threadpool(guard.credentials.principal_of, text)
    except Unauthenticated:
        now = time.monotonic()
        over = guard.limiter.blocked(addr, now)  # past the limit before this one
        guard.limiter.failed(addr, now)
        if over:
            raise TooManyAttempts(f"too many bad tokens from {addr}: the limit is {guard.limiter.limit} bad tokens "
                                  f"per {guard.limiter.window_s:g} s; retry in "
                                  f"{guard.limiter.retry_after(addr, now):.0f} s") from None
        raise


def _check_kind(rule: Rule, who: Principal, method: str, path: str) -> None:
    if who.kind == USER and who.role == SCRAPER:
        if SCRAPER in rule.who:
            return
    elif who.kind == USER and (USER in rule.who or (ADMIN in rule.who and who.admin)):
        return
    if who.kind != USER and who.kind in rule.who:
        return
    wanted = " or ".join(sorted(rule.who))
    raise Forbidden(f"{method} {path} takes a credential of: {wanted}; this is a {who.kind}'s"
                    + (f" (role {who.role})" if who.kind == USER else ""))


def _check_job(guard: Guard, who: Principal, job_id: str) -> None:
    if who.kind == WORKER:
        if who.job_id != job_id:
            raise Forbidden(f"this worker token is for job {who.job_id}, not {job_id}")
        return
    with guard.db.read() as rows:
        job = rows.job(job_id)  # NotFound names the id
        if who.kind == USER and not who.admin and job.user != who.name:
            raise NotFound(f"job {job_id!r} does not exist; `relay ls` lists the jobs")
        if who.kind == NODE:
            placed = rows.s.scalars(select(LaunchRow.id).where(LaunchRow.job_seq == job.seq,
                                                                LaunchRow.node_id == who.node_id).limit(1)).first()
            if placed is None:
                raise Forbidden(f"no launch of {job_id} was placed on node {who.node_id}")
        guard.remember(job.id, job.user, who.node_id if who.kind == NODE else None)


def check_launch(guard: Guard, who: Principal, job_id: str, launch_id: str) -> None:
    """For a batch of logs or metrics a node or worker posts: ``launch_id`` is a launch of
    ``job_id`` on that node (a worker: of its own attempt). Blocks on one read the first time.
    Raises Forbidden naming the launch."""
    if who.kind not in (NODE, WORKER):
        return  # an admin's
    known = guard.launches.get(launch_id)
    if known is None:
        with guard.db.read() as rows:
            row = rows.s.get(LaunchRow, launch_id)
            job = rows.job(job_id) if row is not None else None
            if row is None or job is None or row.job_seq != job.seq:
                raise Forbidden(f"launch {launch_id!r} is not a launch of {job_id}")
            known = (job.id, row.attempt, row.node_id)
        if len(guard.launches) > 100_000:
            guard.launches.clear()
        guard.launches[launch_id] = known
    _, attempt, node_id = known
    if who.kind == NODE and node_id != who.node_id:
        raise Forbidden(f"launch {launch_id} runs on node {node_id}, not on node {who.node_id}")
    if who.kind == WORKER and attempt != who.attempt:
        raise Forbidden(f"launch {launch_id} is of attempt {attempt}; this worker token is of attempt {who.attempt}")


def _check_bundle(guard: Guard, who: Principal, digest: str) -> None:
    with guard.db.read() as rows:
        placed = rows.s.scalars(select(LaunchRow.id).join(JobRow, JobRow.seq == LaunchRow.job_seq)
                                .where(LaunchRow.node_id == who.node_id, JobRow.bundle == digest).limit(1)).first()
    if placed is None:
        raise Forbidden(f"bundle {digest[:12]}… is of no launch placed on node {who.node_id}")


def principal(request: Request) -> Principal:
    """The principal ``authorize`` found (for a route's own use)."""
    return request.state.principal


def api_path(path: str) -> str:
    return API_PREFIX + path
