"""Users, tokens and the credentials of nodes and workers: how they are made, stored and checked.

Contract (no HTTP here; ``guard`` turns a request into a ``Principal`` through this module):
- A token's text is a recognizable prefix and ``secrets.token_urlsafe(32)`` (256 random bits):
  ``rlu_`` a user's token, ``rle_`` a node enrolment token, ``rln_`` a node's own credential.
  Only the sha256 of a text is stored (``TokenRow.digest``); the text is shown once, when made.
- ``rlw_`` is a worker token: ``rlw_<job>.<attempt>.<HMAC-SHA256(server secret, job.attempt)>``;
  nothing is stored for it, and it is valid while its job runs that attempt (``worker_token``).
- ``Credentials(db, clock)``: ``bootstrap_admin`` (the first start's admin), users
  (``add_user``, ``users``, ``remove_user``), tokens (``create_token``, ``tokens``, ``revoke``)
  and ``principal_of(text)``, which raises ``Unauthenticated`` for a text that is unknown,
  revoked, expired, of a removed user or of an attempt that ended. Each call is one short
  transaction (writes under the store's writer lock); no network. A user's or node's token
  checked in the last ``CACHE_S`` seconds is answered from memory; every revocation or removal
  here empties that memory, so a revoked token fails at once (worker tokens are never cached:
  their attempt may end at any moment).
- Errors name the offending value: ``InvalidSpec`` (a bad user name or role), ``NotFound``,
  ``Conflict`` (a user that exists).
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import re
import secrets
import threading
import time
from typing import Any, Callable

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from torchrelay.errors import Conflict, InvalidSpec, NotFound, Unauthenticated
from torchrelay.server.store import AuthKeyRow, TokenRow, UserRow
from torchrelay.spec import JobState

# the states in which a job's current attempt has workers that may call the server; a job
# RESTARTING or requeued (QUEUED) keeps its attempt number until placed again, yet its workers
# are being (or have been) stopped
_ATTEMPT_LIVE = frozenset({JobState.SCHEDULED, JobState.RUNNING, JobState.CANCELLING})
USER, ENROLL, NODE, WORKER = "user", "enroll", "node", "worker"
PREFIX = {USER: "rlu_", ENROLL: "rle_", NODE: "rln_", WORKER: "rlw_"}
ROLES = ("admin", "user", "scraper")  # scraper: /metrics only (Prometheus)
CACHE_S = 5.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: a user (``admin`` or not), a node (``node_id``), a worker of one job's
    attempt, or the bearer of an enrolment token (may only register a node)."""

    kind: str
    name: str
    admin: bool = False
    role: str = "user"  # of a user: admin, user or scraper
    node_id: str | None = None
    job_id: str | None = None
    attempt: int | None = None
    token_id: str | None = None


def digest_of(text: str) -> str:
    # sha256, not a slow password hash: every token is 256 random bits, so no dictionary or
    # brute force applies, and a fast digest lets each request be checked by one indexed lookup
    return hashlib.sha256(text.encode()).hexdigest()


def new_token_text(kind: str) -> str:
    return PREFIX[kind] + secrets.token_urlsafe(32)


def check_user_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise InvalidSpec(f"user name {name!r} is not one: letters, digits and . _ @ - (1-128 characters, "
                          "starting with a letter or digit)")
    return name


class Credentials:
    """See the module docstring. ``db`` is the service's ``rows.Database``."""

    def __init__(self, db: Any, clock: Callable[[], float]):
        self.db = db
        self.clock = clock
        self._secret: bytes | None = None
        self._cache: dict[str, tuple[Principal, float | None, float]] = {}  # digest -> (who, expires_at, cached at)
        self._cache_lock = threading.Lock()

    def _forget(self) -> None:
        with self._cache_lock:
            self._cache.clear()

    # ------------------------------------------------------------ users

    def bootstrap_admin(self, name: str = "admin") -> str | None:
        """On a store without users: make ``name`` an admin and return its new token's text
        (shown once). None when the store has users already."""
        try:
            with self.db.write() as rows:
                if rows.s.scalars(select(UserRow).limit(1)).first() is not None:
                    return None
                rows.s.add(UserRow(name=check_user_name(name), role="admin", created_at=self.clock()))
                return self._add_token(rows.s, USER, user=name, label="first admin")[1]
        except IntegrityError:  # another server of the same store made it first
            return None

    def add_user(self, name: str, role: str = "user") -> dict[str, Any]:
        if role not in ROLES:
            raise InvalidSpec(f"role {role!r} is not one; use one of {', '.join(ROLES)}")
        with self.db.write() as rows:
            if rows.s.get(UserRow, check_user_name(name)) is not None:
                raise Conflict(f"user {name!r} exists already")
            row = UserRow(name=name, role=role, created_at=self.clock())
            rows.s.add(row)
            return _user_public(row)

    def users(self) -> list[dict[str, Any]]:
        with self.db.read() as rows:
            return [_user_public(u) for u in rows.s.scalars(select(UserRow).order_by(UserRow.name))]

    def remove_user(self, name: str) -> None:
        """Remove the user; its tokens stop working at once. Raises NotFound."""
        with self.db.write() as rows:
            user = rows.s.get(UserRow, name)
            if user is None:
                raise NotFound(f"user {name!r} does not exist")
            for token in rows.s.scalars(select(TokenRow).where(TokenRow.user_name == name)):
                token.revoked_at = token.revoked_at or self.clock()
            rows.s.delete(user)
        self._forget()

    # ------------------------------------------------------------ tokens

    def create_token(self, kind: str, *, user: str | None = None, node_id: str | None = None, label: str = "",
                     ttl_s: float | None = None) -> tuple[dict[str, Any], str]:
        """A new token (its public row, its text). Raises NotFound for a user that does not exist."""
        with self.db.write() as rows:
            if user is not None and rows.s.get(UserRow, user) is None:
                raise NotFound(f"user {user!r} does not exist; `relay user add {user}` makes it")
            row, text = self._add_token(rows.s, kind, user=user, node_id=node_id, label=label, ttl_s=ttl_s)
            return _token_public(row, self.clock()), text

    def _add_token(self, session: Any, kind: str, *, user: str | None = None, node_id: str | None = None,
                   label: str = "", ttl_s: float | None = None) -> tuple[TokenRow, str]:
        text, now = new_token_text(kind), self.clock()
        row = TokenRow(id=secrets.token_hex(6), digest=digest_of(text), kind=kind, user_name=user, node_id=node_id,
                       label=label[:128], created_at=now, expires_at=now + ttl_s if ttl_s else None)
        session.add(row)
        return row, text

    def tokens(self, user: str | None = None) -> list[dict[str, Any]]:
        """Every token's public row (never its text), or only ``user``'s."""
        q = select(TokenRow).order_by(TokenRow.created_at)
        if user is not None:
            q = q.where(TokenRow.user_name == user)
        with self.db.read() as rows:
            return [_token_public(t, self.clock()) for t in rows.s.scalars(q)]

    def token_owner(self, token_id: str) -> str | None:
        """The user a token belongs to (None: a node's or an enrolment token). Raises NotFound."""
        with self.db.read() as rows:
            row = rows.s.get(TokenRow, token_id)
            if row is None:
                raise NotFound(f"token {token_id!r} does not exist; `relay token ls` lists them")
            return row.user_name

    def revoke(self, token_id: str) -> None:
        """The token stops working at once. Idempotent. Raises NotFound."""
        with self.db.write() as rows:
            row = rows.s.get(TokenRow, token_id)
            if row is None:
                raise NotFound(f"token {token_id!r} does not exist; `relay token ls` lists them")
            row.revoked_at = row.revoked_at or self.clock()
        self._forget()

    def revoke_node(self, node_id: str) -> None:
        """Revoke the credentials a node holds (it enrols again, e.g. after a restart without them)."""
        with self.db.write() as rows:
            for row in rows.s.scalars(select(TokenRow).where(TokenRow.node_id == node_id)):
                row.revoked_at = row.revoked_at or self.clock()
        self._forget()

    # ------------------------------------------------------------ checks

    def cached_principal(self, text: str) -> Principal | None:
        """Who ``text`` is when a check in the last ``CACHE_S`` said so, else None (look it up with
        ``principal_of``). No I/O: a request's event loop may call it."""
        if text.startswith(PREFIX[WORKER]):
            return None  # never cached: its attempt may end at any moment
        with self._cache_lock:
            hit = self._cache.get(digest_of(text))
        if hit is not None and time.monotonic() - hit[2] < CACHE_S and (hit[1] is None or hit[1] > self.clock()):
            return hit[0]
        return None

    def principal_of(self, text: str) -> Principal:
        """Who ``text`` is. Raises Unauthenticated (see the module docstring)."""
        if text.startswith(PREFIX[WORKER]):
            return self._worker(text)
        cached = self.cached_principal(text)
        if cached is not None:
            return cached
        digest = digest_of(text)
        who, expires_at = self._look_up(digest)
        with self._cache_lock:
            if len(self._cache) > 10000:
                self._cache.clear()
            self._cache[digest] = (who, expires_at, time.monotonic())
        return who

    def _look_up(self, digest: str) -> tuple[Principal, float | None]:
        with self.db.read() as rows:
            row = rows.s.scalars(select(TokenRow).where(TokenRow.digest == digest)).first()
            if row is None or not hmac.compare_digest(row.digest, digest):
                raise Unauthenticated("the token is not known to this server (mistyped, or of another server)")
            if row.kind == USER and row.revoked_at is not None and rows.s.get(UserRow, row.user_name) is None:
                raise Unauthenticated(f"token {row.id}: user {row.user_name!r} was removed")
            if row.revoked_at is not None:
                raise Unauthenticated(f"token {row.id} was revoked")
            if row.expires_at is not None and row.expires_at <= self.clock():
                raise Unauthenticated(f"token {row.id} expired")
            if row.kind == USER:
                user = rows.s.get(UserRow, row.user_name)
                if user is None:
                    raise Unauthenticated(f"token {row.id}: user {row.user_name!r} was removed")
                return Principal(USER, user.name, admin=user.role == "admin", role=user.role,
                                 token_id=row.id), row.expires_at
            return Principal(row.kind, row.node_id or row.id, node_id=row.node_id, token_id=row.id), row.expires_at

    def worker_token(self, job_id: str, attempt: int) -> str:
        """The token of the workers of ``job_id``'s attempt ``attempt`` (the same on every call)."""
        return f"{PREFIX[WORKER]}{job_id}.{attempt}.{self._mac(job_id, attempt)}"

    def _worker(self, text: str) -> Principal:
        try:
            job_id, attempt_text, mac = text.removeprefix(PREFIX[WORKER]).rsplit(".", 2)
            attempt = int(attempt_text)
        except ValueError:
            raise Unauthenticated("the worker token is malformed") from None
        if not hmac.compare_digest(mac, self._mac(job_id, attempt)):
            raise Unauthenticated("the worker token is not one this server made")
        with self.db.read() as rows:
            try:
                job = rows.job(job_id)
            except NotFound:
                raise Unauthenticated(f"the worker token's job {job_id} does not exist") from None
            if job.attempt != attempt or JobState(job.state) not in _ATTEMPT_LIVE:
                raise Unauthenticated(f"the worker token of {job_id} attempt {attempt} ended with its attempt")
        return Principal(WORKER, job_id, job_id=job_id, attempt=attempt)

    def _mac(self, job_id: str, attempt: int) -> str:
        digest = hmac.new(self._key(), f"{job_id}.{attempt}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def _key(self) -> bytes:
        if self._secret is None:
            for _ in range(2):  # twice: another server of the same store may make it between our read and write
                try:
                    with self.db.write() as rows:
                        row = rows.s.get(AuthKeyRow, 1)
                        if row is None:
                            row = AuthKeyRow(id=1, secret=secrets.token_hex(32))
                            rows.s.add(row)
                        secret = row.secret
                    self._secret = bytes.fromhex(secret)
                    break
                except IntegrityError:
                    continue
        assert self._secret is not None
        return self._secret


def _user_public(row: UserRow) -> dict[str, Any]:
    return {"name": row.name, "role": row.role, "created_at": row.created_at}


def _token_public(row: TokenRow, now: float) -> dict[str, Any]:
    state = ("revoked" if row.revoked_at is not None else
             "expired" if row.expires_at is not None and row.expires_at <= now else "active")
    return {"id": row.id, "kind": row.kind, "user": row.user_name, "node_id": row.node_id, "label": row.label,
            "created_at": row.created_at, "expires_at": row.expires_at, "state": state}
