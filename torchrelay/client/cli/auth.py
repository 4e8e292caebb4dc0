"""`relay login`, `relay logout`, `relay whoami`, `relay user add|ls|rm`, `relay token create|ls|revoke`, `relay node enroll-token`.

A token is printed only by the verb that made it, once; `login` checks a token with the server
(``/whoami``) before it stores it (``credentials``: one per server address, mode 0600).
"""
from __future__ import annotations

import datetime

import typer
from rich.table import Table

from torchrelay.client.cli.common import Output, OutputOpt, client, console, dump, fail, handle_errors, print_json

user_app = typer.Typer(help="users of the server (admin)", no_args_is_help=True)
token_app = typer.Typer(help="your tokens (an admin: anyone's)", no_args_is_help=True)
node_app = typer.Typer(help="nodes: enrolment tokens for agents (admin)", no_args_is_help=True)
ExpiresOpt = typer.Option(None, "--expires", help="lifetime, e.g. 30d, 12h (default: until revoked)")


def _seconds(expires: str | None) -> float | None:
    from torchrelay.durations import parse_duration

    return parse_duration(expires) if expires else None


def _when(t: float | None) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") if t else "-"


@handle_errors
def login(address: str = typer.Option(None, "--address", help="server URL (default: RELAY_ADDRESS, else the "
                                      "embedded cluster's)"),
          token: str = typer.Option(None, "--token", help="the token (default: asked for, not echoed)")) -> None:
    """Store a token for a server, checked with it first; later commands to that address send it."""
    from torchrelay.client.credentials import store_token
    from torchrelay.client.sdk import RelayClient, resolve_address

    resolved = resolve_address(address)
    if resolved is None:
        fail("no server is named: give --address URL or set RELAY_ADDRESS")
    named = resolved[0]
    token = (token or typer.prompt("token", hide_input=True)).strip()
    with RelayClient(named, token=token) as c:
        who = c.admin.whoami()
    if who["kind"] != "user":
        fail(f"that is a {who['kind']}'s credential, not a user's token; `relay token create` makes one")
    path = store_token(named, token)
    console.print(f"logged in to {named} as [bold]{who['name']}[/]{' (admin)' if who['admin'] else ''}; "
                  f"token kept in {path}", highlight=False)


@handle_errors
def logout(address: str = typer.Option(None, "--address", help="server URL (default: RELAY_ADDRESS, else the "
                                       "embedded cluster's)")) -> None:
    """Forget the token stored for a server (it stays valid: `relay token revoke` ends it)."""
    from torchrelay.client.credentials import forget_token
    from torchrelay.client.sdk import resolve_address

    resolved = resolve_address(address)
    if resolved is None:
        fail("no server is named: give --address URL or set RELAY_ADDRESS")
    gone = forget_token(resolved[0])
    console.print(f"{'forgot the token' if gone else 'no token was stored'} for {resolved[0]}", highlight=False)


@handle_errors
def whoami() -> None:
    """Who the token in use is, at the server in use."""
    with client() as c:
        who = c.admin.whoami()
    console.print(f"{who['name']} ({who['kind']}{', admin' if who['admin'] else ''}) at {c.address}", highlight=False)


@user_app.command("add")
@handle_errors
def user_add(name: str, admin: bool = typer.Option(False, "--admin", help="make an admin (--role admin)"),
             role: str = typer.Option("user", "--role", help="user, admin, or scraper (may read /metrics only: "
                                      "for Prometheus)"),
             token: bool = typer.Option(True, "--token/--no-token", help="also make the user's first token"),
             expires: str = ExpiresOpt) -> None:
    """Add a user (and print its first token, this once)."""
    with client() as c:
        c.admin.add_user(name, "admin" if admin else role)
        made = c.admin.create_token(name, label="first", expires_in_s=_seconds(expires)) if token else None
    console.print(f"user {name} added" + (" (admin)" if admin else f" ({role})" if role != "user" else ""),
                  highlight=False)
    if made:
        console.print(f"token (shown this once): {made['token']}", highlight=False, soft_wrap=True)


@user_app.command("ls")
@handle_errors
def user_ls(output: Output = OutputOpt) -> None:
    """The users and their roles."""
    with client() as c:
        users = c.admin.users()
    if output == Output.json:
        return print_json(users)
    table = Table(box=None, header_style="bold")
    for col in ("NAME", "ROLE", "CREATED"):
        table.add_column(col)
    for u in users:
        table.add_row(u["name"], u["role"], _when(u["created_at"]))
    console.print(table)


@user_app.command("rm")
@handle_errors
def user_rm(name: str) -> None:
    """Remove a user: its tokens stop working at once (its jobs stay)."""
    with client() as c:
        c.admin.remove_user(name)
    console.print(f"user {name} removed", highlight=False)


@token_app.command("create")
@handle_errors
def token_create(user: str = typer.Option(None, "--user", help="whose (default: yours; another's: admin)"),
                 label: str = typer.Option("", "--label", help="what it is for"),
                 expires: str = ExpiresOpt) -> None:
    """Make a token; it is printed this once."""
    with client() as c:
        made = c.admin.create_token(user, label=label, expires_in_s=_seconds(expires))
    console.print(f"token {made['id']} for {made['user']} (expires {_when(made['expires_at'])}):", highlight=False)
    print(made["token"])


@token_app.command("ls")
@handle_errors
def token_ls(output: Output = OutputOpt) -> None:
    """Tokens (never their text): yours; an admin sees every user's and node's."""
    with client() as c:
        tokens = c.admin.tokens()
    if output == Output.json:
        return print_json(dump(tokens))
    table = Table(box=None, header_style="bold")
    for col in ("ID", "KIND", "OF", "LABEL", "STATE", "CREATED", "EXPIRES"):
        table.add_column(col)
    for t in tokens:
        table.add_row(t["id"], t["kind"], t["user"] or t["node_id"] or "", t["label"], t["state"],
                      _when(t["created_at"]), _when(t["expires_at"]))
    console.print(table)


@token_app.command("revoke")
@handle_errors
def token_revoke(token_id: str) -> None:
    """Revoke a token by its id (`relay token ls`): it stops working at once."""
    with client() as c:
        c.admin.revoke_token(token_id)
    console.print(f"token {token_id} revoked", highlight=False)


@node_app.command("enroll-token")
@handle_errors
def node_enroll_token(expires: str = ExpiresOpt, label: str = typer.Option("", "--label")) -> None:
    """A node enrolment token: `relay agent --enroll-token T` (or RELAY_ENROLL_TOKEN) registers with it."""
    with client() as c:
        made = c.admin.enroll_token(label=label, expires_in_s=_seconds(expires))
    console.print(f"enrolment token {made['id']} (expires {_when(made['expires_at'])}):", highlight=False)
    print(made["token"])
