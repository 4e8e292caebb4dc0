"""An HTTP error reply of the API as the error class the server named (``torchrelay.errors``).

``raise_for_error(resp)`` returns for a status below 400 and otherwise raises: the class named
by the body's ``error`` (``NotFound`` for an unnamed 404, ``RelayError`` for others) with its
``detail``. Reads a streamed body first.
"""
from __future__ import annotations

import httpx

from torchrelay.errors import NotFound, RelayError, error_class


def raise_for_error(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    resp.read()
    try:
        body = resp.json()
        cls, detail = error_class(body.get("error", "")), body.get("detail", resp.text)
    except ValueError:
        cls, detail = RelayError, resp.text or f"HTTP {resp.status_code}"
    if cls is RelayError and resp.status_code == 404:
        cls = NotFound
    raise cls(detail)
