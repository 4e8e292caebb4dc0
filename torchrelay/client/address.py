"""Where `relay up` listens, and what to say when no server answers (pure: no I/O, no
environment reads; the callers pass ``RELAY_ADDRESS`` and what ``RELAY_HOME`` records).

Contract:
- ``parse_address(url, name)`` splits ``http://HOST[:PORT]`` into a ``ServerAddress``; raises
  ``InvalidSpec`` naming ``name`` (e.g. ``RELAY_ADDRESS``) and the value when it is not one.
- ``listen_plan(relay_address, port)`` decides where an embedded cluster's server listens:
  with ``RELAY_ADDRESS`` set, on its host and port, so that every later command reaches it;
  otherwise on 127.0.0.1 and ``port`` (None or 0: the OS picks). Raises ``Conflict`` naming
  ``RELAY_ADDRESS`` when it asks for what a local server cannot be (https, or a port other
  than ``--port``). Whether the host is this machine's and the port free is for the caller to
  try (``ListenPlan.refusal`` words the answer).
- ``unreachable_message(address, source, recorded)`` is the "no server answers" line: it names
  where the address came from and, when ``RELAY_ADDRESS`` and the server recorded in
  ``RELAY_HOME`` disagree, both.
"""
from __future__ import annotations

import enum
import errno
from dataclasses import dataclass
from urllib.parse import urlsplit

from torchrelay.errors import Conflict, InvalidSpec

LOCAL_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ServerAddress:
    scheme: str
    host: str  # without the brackets of an IPv6 literal
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_address(url: str, name: str = "RELAY_ADDRESS") -> ServerAddress:
    """``url`` as scheme, host and port (http's 80 and https's 443 when it gives none)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise InvalidSpec(f"{name}={url!r} is not a server URL ({exc}); use http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise InvalidSpec(f"{name}={url!r} is not a server URL; use http://HOST:PORT")
    return ServerAddress(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80))


@dataclass(frozen=True, slots=True)
class ListenPlan:
    """Where the server of an embedded cluster listens. ``port`` 0: the OS picks one.
    ``source`` says who asked for this address (None: nobody did)."""

    host: str = LOCAL_HOST
    port: int = 0
    source: str | None = None

    def refusal(self, error_number: int | None, detail: str) -> str:
        """Why the server cannot listen here, naming who asked for the address (``error_number``:
        the errno of trying to bind, None when the host did not resolve)."""
        where = f"{self.host}:{self.port}"
        if error_number == errno.EADDRINUSE:
            why = f"port {self.port} is in use on this machine"
        elif error_number == errno.EADDRNOTAVAIL:
            why = f"{self.host} is not an address of this machine"
        elif error_number is None:
            why = f"{self.host} does not resolve ({detail})"
        else:
            why = detail
        if self.source is None:
            return f"cannot listen on {where}: {why}"
        fix = ("unset RELAY_ADDRESS (the OS then picks a port) or set it to a free local address, "
               "e.g. http://127.0.0.1:PORT" if self.source.startswith("RELAY_ADDRESS")
               else "choose another port, or leave --port out (the OS then picks one)")
        return f"relay up cannot listen where {self.source} says ({where}): {why}; {fix}"


def listen_plan(relay_address: str | None, port: int | None = None) -> ListenPlan:
    """See the module contract. Raises ``InvalidSpec`` or ``Conflict`` naming RELAY_ADDRESS."""
    if not relay_address:
        return ListenPlan(port=port or 0, source=f"--port {port}" if port else None)
    wanted = parse_address(relay_address)
    source = f"RELAY_ADDRESS={relay_address}"
    if wanted.scheme != "http":
        raise Conflict(f"{source} asks for https; relay up serves plain http on this machine. "
                       "Unset RELAY_ADDRESS, or set it to http://127.0.0.1:PORT")
    if port is not None and port != wanted.port:
        raise Conflict(f"--port {port} and {source} (port {wanted.port}) disagree: every later command "
                       "talks to RELAY_ADDRESS; give one, or make them agree")
    return ListenPlan(host=wanted.host, port=wanted.port, source=source)


class AddressSource(str, enum.Enum):
    """Where a client's server address came from."""

    ARGUMENT = "argument"
    ENVIRONMENT = "RELAY_ADDRESS"
    HOME = "RELAY_HOME"


def unreachable_message(address: str, source: AddressSource, error: str, *, home: str,
                        recorded: str | None) -> str:
    """The "no server answers" line. ``recorded``: the address of the server that ``home``
    (``RELAY_HOME``) records, if any."""
    head = f"no torchrelay server answers at {address} ({error})"
    if source is AddressSource.ENVIRONMENT:
        if recorded and recorded.rstrip("/") != address:
            return (f"{head}, which RELAY_ADDRESS names; the embedded cluster in RELAY_HOME ({home}) is at "
                    f"{recorded}. Unset RELAY_ADDRESS to use that one, or start a server where RELAY_ADDRESS "
                    "says with `relay up` (it listens there)")
        return (f"{head}, which RELAY_ADDRESS names. Start one there with `relay up` (it listens where "
                "RELAY_ADDRESS says), or point RELAY_ADDRESS at a running server")
    if source is AddressSource.HOME:
        return (f"{head}, the server recorded in RELAY_HOME ({home}); it has stopped. Start one with "
                "`relay up`, or point RELAY_ADDRESS at a running server")
    return f"{head}. Start one with `relay up`, or point RELAY_ADDRESS at a running server"
