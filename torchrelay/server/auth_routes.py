"""Routes of users, tokens, node enrolment and the dashboard's session (``guard.RULES`` says who
may call each; these add what a rule cannot: a user manages their own tokens, an admin anyone's).

- ``GET /whoami``; ``GET|POST /users``, ``DELETE /users/{name}`` (admin);
  ``GET|POST /tokens``, ``DELETE /tokens/{token_id}`` (one's own; an admin: anyone's);
  ``POST /nodes/enroll-tokens`` (admin); ``POST /session`` (sets the dashboard's cookie).
- A token's text is in the reply that made it, and nowhere else, ever.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from torchrelay.errors import Forbidden
from torchrelay.server.auth import ENROLL, USER, Credentials
from torchrelay.server.guard import COOKIE, principal, token_of
from torchrelay.wire import API_PREFIX


class NewUser(BaseModel):
    name: str
    role: str = "user"


class NewToken(BaseModel):
    user: str | None = Field(default=None, description="whose (default: the caller; another's: admin only)")
    label: str = ""
    expires_in_s: float | None = Field(default=None, gt=0, le=100 * 365 * 86400, allow_inf_nan=False)


class NewEnrollToken(BaseModel):
    label: str = ""
    expires_in_s: float | None = Field(default=None, gt=0, le=100 * 365 * 86400, allow_inf_nan=False)


def auth_routes(creds: Credentials) -> APIRouter:
    api = APIRouter(prefix=API_PREFIX)

    @api.get("/whoami")
    def whoami(request: Request) -> dict[str, Any]:
        """Who the request's credential is: kind (user, node, worker, enroll), name, admin."""
        who = principal(request)
        return {"kind": who.kind, "name": who.name, "admin": who.admin, "node_id": who.node_id,
                "job_id": who.job_id, "token_id": who.token_id}

    @api.get("/users")
    def list_users() -> list[dict[str, Any]]:
        return creds.users()

    @api.post("/users", status_code=201)
    def add_user(body: NewUser) -> dict[str, Any]:
        """A user (``role`` user or admin); then ``POST /tokens`` with ``user`` gives it a token."""
        return creds.add_user(body.name, body.role)

    @api.delete("/users/{name}")
    def remove_user(name: str) -> dict[str, Any]:
        """Remove a user; its tokens stop working at once (its jobs stay)."""
        creds.remove_user(name)
        return {"ok": True}

    @api.get("/tokens")
    def list_tokens(request: Request) -> list[dict[str, Any]]:
        """Tokens (never their text): one's own; an admin's list has everyone's and the nodes'."""
        who = principal(request)
        return creds.tokens(None if who.admin else who.name)

    @api.post("/tokens", status_code=201)
    def create_token(body: NewToken, request: Request) -> dict[str, Any]:
        """A new user token; ``token`` in the reply is its text, shown this once."""
        who = principal(request)
        user = body.user or who.name
        if user != who.name and not who.admin:
            raise Forbidden(f"only an admin makes tokens for another user ({user!r}); you are {who.name!r}")
        info, text = creds.create_token(USER, user=user, label=body.label, ttl_s=body.expires_in_s)
        return {**info, "token": text}

    @api.delete("/tokens/{token_id}")
    def revoke_token(token_id: str, request: Request) -> dict[str, Any]:
        """Revoke a token: it stops working at once. One's own; an admin: any (a node's too)."""
        who = principal(request)
        if not who.admin and creds.token_owner(token_id) != who.name:
            raise Forbidden(f"token {token_id!r} is not yours; only an admin revokes another's")
        creds.revoke(token_id)
        return {"ok": True}

    @api.post("/nodes/enroll-tokens", status_code=201)
    def create_enroll_token(body: NewEnrollToken) -> dict[str, Any]:
        """A node enrolment token: an agent registers with it and gets its own node credential."""
        info, text = creds.create_token(ENROLL, label=body.label or "enrolment", ttl_s=body.expires_in_s)
        return {**info, "token": text}

    @api.post("/session", status_code=204)
    async def session(request: Request) -> Response:
        """The dashboard's sign-in: the request's bearer token becomes an HttpOnly, SameSite=Strict
        cookie, which the pages' fetches and EventSources then send."""
        resp = Response(status_code=204)
        resp.set_cookie(COOKIE, token_of(request) or "", httponly=True, samesite="strict", path="/",
                        secure=request.url.scheme == "https")
        return resp

    return api
