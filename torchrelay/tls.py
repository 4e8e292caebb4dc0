"""TLS on the control plane: which CA a client trusts, and what a failed handshake means.

Contract:
- ``configured_ca(explicit=None, env=os.environ)``: the CA file a client trusts: ``explicit``
  (``--ca``), else ``RELAY_CA``, else None (the system's CAs). Made absolute, so a path handed
  on to workers (``RELAY_CA`` in their environment) means the same file in their working
  directory. Pure but for reading ``env``.
- ``verify_for(address, ca=None)``: the ``verify=`` argument of an httpx client for
  ``address``: ``True`` for plain ``http://`` (nothing to verify), else an ``ssl.SSLContext``
  that trusts ``configured_ca(ca)`` only, or the system's CAs when none is set. Raises
  ``InvalidSpec`` naming the file and where it came from when it cannot be read as PEM
  certificates. Reads the CA file; no network.
- ``tls_failure(exc, address, ca=None)``: for an httpx transport error, the
  ``UntrustedServer`` to raise instead when TLS caused it (the certificate did not verify, or
  the peer does not speak TLS), else None. Its message names the server address, the CA in use
  and ``--ca`` / ``RELAY_CA``.
- ``plain_to_tls_hint(address)``: the sentence to add when a plain-HTTP call was cut off without
  an answer, which is how a TLS server treats one.
"""
from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

from torchrelay.errors import InvalidSpec, UntrustedServer

__all__ = ["CA_ENV", "configured_ca", "verify_for", "tls_failure", "plain_to_tls_hint"]

CA_ENV = "RELAY_CA"
FIX = f"give the CA certificate that signed the server's certificate with --ca FILE or {CA_ENV}=FILE"


def configured_ca(explicit: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """See the module contract."""
    value = explicit if explicit else (os.environ if env is None else env).get(CA_ENV)
    return os.path.abspath(os.fspath(value)) if value else None


def verify_for(address: str, ca: str | os.PathLike | None = None) -> ssl.SSLContext | bool:
    """See the module contract."""
    if urlsplit(address.split(",")[0].strip()).scheme != "https":
        return True
    path = configured_ca(ca)
    if path is None:
        return ssl.create_default_context()
    origin = "--ca" if ca else f"{CA_ENV} (relay --ca)"
    try:
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidSpec(f"{origin} {path!r} is not a readable file of PEM CA certificates ({reason}); "
                          "give the CA certificate that signed the server's certificate") from None


def _ssl_cause(exc: BaseException) -> ssl.SSLError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def tls_failure(exc: BaseException, address: str, ca: str | os.PathLike | None = None) -> UntrustedServer | None:
    """See the module contract."""
    cause = _ssl_cause(exc)
    if cause is None:
        return None
    trusted = configured_ca(ca)
    trusting = f"trusting {trusted}" if trusted else "trusting the system's CAs (no --ca or RELAY_CA given)"
    if isinstance(cause, ssl.SSLCertVerificationError):
        reason = cause.verify_message or cause.reason or str(cause)
        return UntrustedServer(f"the TLS certificate of the server at {address} does not verify ({reason}), "
                               f"{trusting}: {FIX}")
    reason = getattr(cause, "reason", None) or str(cause)
    return UntrustedServer(f"no TLS handshake with the server at {address} ({reason}), {trusting}: if that server "
                           "serves plain HTTP (no --tls-cert), its address is http://…; otherwise " + FIX)


def plain_to_tls_hint(address: str) -> str:
    """See the module contract."""
    if urlsplit(address).scheme != "http":
        return ""
    https = "https://" + address.split("://", 1)[1]
    return (f"; a server started with --tls-cert closes plain-HTTP connections like this: "
            f"if it is one, its address is {https}")
