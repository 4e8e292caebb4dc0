"""Shared pieces of the CLI verbs: output format, console, client, error reporting.

Every verb is a thin call of the SDK; errors from ``torchrelay.errors`` are printed as one
line naming what went wrong (no traceback) and exit with status 1 (2 when no server answers).
"""
from __future__ import annotations

import enum
import functools
import json
import sys
import time
from typing import Any, Callable, TypeVar

import typer
from rich.console import Console

from torchrelay.errors import RelayError, ServerUnavailable

console = Console()
err_console = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


class Output(str, enum.Enum):
    table = "table"
    json = "json"


OutputOpt = typer.Option(Output.table, "--output", "-o", help="table (for people) or json (for scripts)")


def client(address: str | None = None):  # noqa: ANN201 - avoids importing httpx for --help
    from torchrelay.client.sdk import RelayClient

    return RelayClient(address)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def dump(model_or_list: Any) -> Any:
    if isinstance(model_or_list, list):
        return [dump(x) for x in model_or_list]
    return model_or_list.model_dump(mode="json") if hasattr(model_or_list, "model_dump") else model_or_list


def fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code)


def key_values(items: list[str], flag: str) -> dict[str, str]:
    """``["k=v", …]`` of a repeatable option as a dict; exits naming ``flag`` and the item otherwise."""
    out = {}
    for item in items:
        if "=" not in item:
            fail(f"{flag} {item!r} is not key=value")
        key, value = item.split("=", 1)
        out[key] = value
    return out


def handle_errors(fn: F) -> F:
    """Turn torchrelay errors into one clear line and an exit status."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ServerUnavailable as exc:
            fail(str(exc), 2)
        except RelayError as exc:
            fail(str(exc), 1)

    return wrapper  # type: ignore[return-value]


def ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    return duration(time.time() - ts) + " ago"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


STATE_STYLE = {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan",
               "RESTARTING": "magenta", "QUEUED": "white", "SCHEDULED": "blue", "CANCELLING": "yellow"}


def styled_state(state: str) -> str:
    return f"[{STATE_STYLE.get(state, 'white')}]{state}[/]"
