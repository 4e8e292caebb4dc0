"""One error tree for torchrelay.

Every message names the offending value and, where it helps, what would be right.
The server maps these to HTTP status codes through ``http_status``; the client maps
HTTP errors back to the same classes, so ``except NotFound`` works on both sides.
"""
from __future__ import annotations


class RelayError(Exception):
    """Base of every torchrelay error."""

    http_status = 500


class InvalidSpec(RelayError):
    """A job spec (or another request body) is malformed: names the field and value."""

    http_status = 422


class NotFound(RelayError):
    """An unknown job, node, artifact or bundle id: names the id."""

    http_status = 404


class Conflict(RelayError):
    """The request is well formed but not allowed now, e.g. an illegal state transition."""

    http_status = 409


class Unschedulable(RelayError):
    """A job could never fit the cluster (more workers, cpus, gpus or memory than it has)."""

    http_status = 422


class StreamError(RelayError):
    """A stream a dataset cannot read as asked (a missing topic or stream, a partition count
    that cannot be split over the job's ranks): names it and the counts."""

    http_status = 422


class InsufficientMemory(InvalidSpec):
    """A job's training state cannot fit the memory its workers have: names the figures and what would fit."""


class InvalidPath(InvalidSpec):
    """A file name or path a request, spec or worker gave would leave its job's folder or is not
    plain (``..``, absolute, %-escapes...; see ``torchrelay.paths``): names it and what is allowed."""

    http_status = 400


class PayloadTooLarge(RelayError):
    """An upload (bundle, artifact, log or metric batch) is over the server's limit: names the
    limit and the setting that raises it."""

    http_status = 413


class ServerUnavailable(RelayError):
    """No torchrelay server answers at the address the client was given."""

    http_status = 503


class UntrustedServer(ServerUnavailable):
    """The server's TLS certificate does not verify against the CA the client trusts (``--ca``,
    ``RELAY_CA``, else the system's), or the peer does not speak TLS: names the address."""


class ExecutorUnavailable(RelayError):
    """An executor's cluster manager did not answer (e.g. ``slurmctld`` unreachable): names the
    command and what it said. Jobs keep their last known state; the executor retries."""

    http_status = 503


class StorageError(RelayError):
    """The artifact store could not read or write (missing path, full disk, permissions)."""

    http_status = 507


class StoreUnavailable(RelayError):
    """The state store (the ``--db`` URL) cannot be reached: names the URL, password hidden,
    and the driver's reason."""

    http_status = 503


class NotLeader(RelayError):
    """This server follows another one, which leads the cluster: names the leader (also in the
    reply's ``leader`` field and ``x-relay-leader`` header)."""

    http_status = 503


class CheckpointCorrupt(StorageError):
    """A checkpoint failed verification (missing manifest, bad checksum, missing file)."""


class StaleAttempt(Conflict):
    """A worker of a job attempt the server has since replaced tried to change the job's
    checkpoints (an orphan on a node that lost contact); nothing was written."""


class Unauthenticated(RelayError):
    """No credential, or one the server does not accept (unknown, revoked, expired)."""

    http_status = 401


class Forbidden(RelayError):
    """A valid credential that may not do this (a node credential submitting a job, a user
    managing another's tokens)."""

    http_status = 403


class TooManyAttempts(RelayError):
    """Too many bad credentials from one client address in the rate limiter's window."""

    http_status = 429


_BY_NAME = {cls.__name__: cls for cls in (RelayError, InvalidSpec, NotFound, Conflict, InsufficientMemory,
                                            InvalidPath, PayloadTooLarge,
                                            Unschedulable, ServerUnavailable, StorageError,
                                            CheckpointCorrupt, StaleAttempt, StoreUnavailable, NotLeader,
                                            UntrustedServer, Unauthenticated, Forbidden, TooManyAttempts)}


def error_class(name: str) -> type[RelayError]:
    """The error class called ``name``; ``RelayError`` for names this version does not know."""
    return _BY_NAME.get(name, RelayError)
