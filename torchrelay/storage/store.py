"""``ArtifactStore``: bundles, artifacts, checkpoints and the attempt fence in one fsspec store.

The store is a URL: a local folder, ``file://…``, ``s3://bucket/prefix`` (AWS S3, Ceph RGW,
MinIO), ``hdfs://…`` or any fsspec URL, with optional store options (see
torchrelay.storage.options and docs/storage.md). Keys are built by torchrelay.storage.keys.

Contract:
- Whole-file writes (``put_bytes``, ``put_file``, ``open_write``) are atomic: a reader sees the
  old file or the new one, never a part; a writer that fails or dies leaves the old one.
- ``put_if_absent`` never overwrites; ``advance_fence`` never moves the fence back. Both are
  one atomic operation of the store where ``capabilities()`` says ``ATOMIC``, else a check
  followed by a write.
- Every method raises ``StorageError`` naming the URL and the cause (full disk, permissions,
  the S3 store's own reason) and ``NotFound`` for a missing key; no message holds a secret.
- Making a store sends no request; ``check()`` does (the server calls it at start).
Safe to share between threads (fsspec file systems are).
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
from typing import IO, Any, Iterator, Mapping

from torchrelay.errors import NotFound, StaleAttempt, StorageError
from torchrelay.storage import keys
from torchrelay.storage.backend import temp_name
from torchrelay.storage.conditional import Capabilities, FenceStep, fence_step, parse_attempt
from torchrelay.storage.connect import open_store
from torchrelay.storage.failures import client_error_of, describe_os_error, redact
from torchrelay.storage.options import public_options

CHECK_KEY = ".relay-check"
# a compare-and-swap loses only to another writer of the same key: a few rounds always settle it
_FENCE_ROUNDS = 8


class ArtifactStore:
    """A store rooted at ``url``; ``options`` configure its file system (see the module docstring)."""

    bundle_key = staticmethod(keys.bundle_key)
    job_prefix = staticmethod(keys.job_prefix)
    artifact_key = staticmethod(keys.artifact_key)
    attempt_key = staticmethod(keys.attempt_key)
    checkpoint_prefix = staticmethod(keys.checkpoint_prefix)

    def __init__(self, url: str, options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/") if url not in ("/",) else url
        opened = open_store(self.url, options or {}, os.environ)
        self.fs, self.root, self.protocol = opened.fs, opened.root, opened.protocol
        self._local, self._backend, self._secrets = opened.local, opened.backend, opened.secrets
        # what ``fs`` raises when the store fails (OSError, and a client library's own transport
        # errors): for callers that read through ``fs`` themselves
        self.failures: tuple[type[BaseException], ...] = opened.backend.failures
        # what a worker is told besides the URL (never a credential: workers bring their own)
        self.public_options: dict[str, str] = public_options(options or {})
        if self._local:
            os.makedirs(self.root, exist_ok=True)

    @property
    def local(self) -> bool:
        """Whether the store is a folder of this host's file system (``full_path`` can be opened directly)."""
        return self._local

    def __repr__(self) -> str:
        return f"ArtifactStore({self.url!r})"

    # ------------------------------------------------------------ paths

    def full_path(self, key: str) -> str:
        """Path of ``key`` as the file system of this store names it."""
        return posixpath.join(self.root, key) if self.root else key

    def _read_path(self, key: str) -> str:
        """``full_path(key)`` for a read. In a local store, a key reached through a symbolic link
        is refused (``NotFound``): a job's code writes into its own folder of a shared local store,
        and a link it planted there must not make the server serve a file outside that folder."""
        path = self.full_path(key)
        if self._local and os.path.realpath(path) != os.path.join(os.path.realpath(self.root), key):
            raise NotFound(f"no artifact at {self.url_of(key)} (it is reached through a symbolic link, "
                           "which the store does not follow)")
        return path

    def url_of(self, key: str) -> str:
        """fsspec URL of ``key`` (what a worker on another host can open)."""
        return f"{self.url}/{key}"

    # ------------------------------------------------------------ start

    def check(self) -> None:
        """Prove the store answers and can be written (a scratch key is written and deleted).
        Blocks for a round trip or a few. Raises ``StorageError`` with the store's reason."""
        with self._failures("is not usable", CHECK_KEY, whole_store=True):
            self._backend.check(self.full_path(CHECK_KEY))

    def capabilities(self) -> Capabilities:
        """What ``put_if_absent`` and ``advance_fence`` guarantee here; an S3 store is probed once."""
        with self._failures("cannot be probed", CHECK_KEY, whole_store=True):
            return self._backend.capabilities()

    # ------------------------------------------------------------ bytes and files

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` atomically. Raises ``StorageError``."""
        with self._failures("write", key):
            self._backend.put_atomic(self.full_path(key), data)

    def get_bytes(self, key: str) -> bytes:
        with self._failures("read", key):
            return self.fs.cat_file(self._read_path(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive) of ``key``, in one ranged read: on S3 one GET,
        where ``get_bytes`` asks the size first (a HEAD). Shorter when ``key`` is. Raises ``NotFound``."""
        if not 0 <= start < end:
            raise ValueError(f"the range {start}..{end} of {self.url_of(key)} must have 0 <= start < end")
        with self._failures("read", key):
            return self.fs.cat_file(self._read_path(key), start=start, end=end)

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[IO[bytes]]:
        """A binary file that becomes ``key`` when the block ends; if the block raises, ``key`` is unchanged."""
        with self._failures("write", key), self._backend.open_atomic_writer(self.full_path(key)) as fh:
            yield fh

    def put_file(self, key: str, local_path: str | os.PathLike) -> None:
        """Copy the local file ``local_path`` to ``key`` atomically, streaming. Raises ``StorageError``."""
        with self.open_write(key) as out, open(local_path, "rb") as source:
            shutil.copyfileobj(source, out, length=8 << 20)

    @contextlib.contextmanager
    def open_read(self, key: str) -> Iterator[IO[bytes]]:
        """``key`` as a binary file to read. Raises ``NotFound``, ``StorageError`` (also while reading)."""
        with self._failures("read", key), self.fs.open(self._read_path(key), "rb") as fh:
            yield fh

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        """Copy ``key`` to the local file ``local_path``, which appears whole or not at all."""
        tmp = temp_name(os.fspath(local_path))
        try:
            with self._failures("read", key), self.fs.open(self._read_path(key), "rb") as source, \
                    open(tmp, "wb") as out:
                shutil.copyfileobj(source, out, length=8 << 20)
            os.replace(tmp, local_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def exists(self, key: str) -> bool:
        with self._failures("look up", key):
            return self.fs.exists(self.full_path(key))

    def size(self, key: str) -> int:
        with self._failures("look up", key):
            return int(self.fs.size(self._read_path(key)))

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key relative to ``prefix``, size) of every file below ``prefix``, sorted; skips temp files."""
        base = self.full_path(prefix).rstrip("/")
        with self._failures("list", prefix):
            try:  # no exists() first: on S3 that is two more round trips (HEAD, then a listing)
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return iter(())
        out = []
        for path, info in found.items():
            rel = keys.relative_to(base, path)
            if keys.TEMP_MARK in rel:
                continue
            out.append((rel, int(info.get("size") or 0)))
        return iter(sorted(out))

    def delete_prefix(self, prefix: str) -> None:
        path = self.full_path(prefix)
        with self._failures("delete", prefix):
            self._backend.delete_tree(path)

    # ------------------------------------------------------------ conditional writes

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write ``data`` at ``key`` unless something is there; True if this call wrote it.
        Never overwrites (atomically so where ``capabilities().put_if_absent`` is ``ATOMIC``)."""
        with self._failures("write", key):
            return self._backend.put_if_absent(self.full_path(key), data)

    def read_fence(self, job_id: str) -> int | None:
        """The attempt the fence of ``job_id`` holds; None if it has none."""
        try:
            return parse_attempt(self.get_bytes(keys.attempt_key(job_id)))
        except NotFound:
            return None

    def advance_fence(self, job_id: str, attempt: int) -> None:
        """Set the fence of ``job_id`` to ``attempt`` unless it holds a newer one.

        Idempotent: the attempt already stored is left as it is (a retried advance). Raises
        ``StaleAttempt`` when a newer attempt is stored, ``StorageError`` when the store fails.
        A compare-and-swap where the store has one (``capabilities().compare_and_swap``), so two
        advances racing cannot move the fence back; else a read, then a write."""
        if attempt < 0:
            raise ValueError(f"attempt={attempt!r} must be >= 0")
        key = keys.attempt_key(job_id)
        path = self.full_path(key)
        for _ in range(_FENCE_ROUNDS):
            with self._failures("advance the fence at", key):
                current = self._backend.read_versioned(path)
                stored = parse_attempt(current.data if current else None)
                step = fence_step(stored, attempt)
                if step is FenceStep.REFUSE:
                    raise StaleAttempt(f"the fence of {job_id} holds attempt {stored}: attempt {attempt} is stale")
                if step is FenceStep.UNCHANGED or self._backend.replace_if(path, str(attempt).encode(), current):
                    return
        raise StorageError(f"cannot advance the fence at {self.url_of(key)}: it kept changing "
                           f"({_FENCE_ROUNDS} rounds)")

    # ------------------------------------------------------------ failures

    @contextlib.contextmanager
    def _failures(self, action: str, key: str, *, whole_store: bool = False) -> Iterator[None]:
        """Turn the file system's errors into ``NotFound``/``StorageError``: "cannot <action> <key's URL>",
        or for ``whole_store`` "the store <URL> <action>" (and a missing path is no ``NotFound`` there)."""
        try:
            yield
        except FileNotFoundError as exc:
            if not (whole_store or _bucket_missing(exc)):
                raise NotFound(f"no artifact at {self.url_of(key)}") from None
            raise self._error(action, key, exc, whole_store) from exc
        except self._backend.failures as exc:
            raise self._error(action, key, exc, whole_store) from exc

    def _error(self, action: str, key: str, exc: BaseException, whole_store: bool) -> StorageError:
        said = f"the store {self.url} {action}" if whole_store else f"cannot {action} {self.url_of(key)}"
        return StorageError(redact(f"{said}: {describe_os_error(exc)}", self._secrets))


def _bucket_missing(exc: BaseException) -> bool:
    response = client_error_of(exc)
    return response is not None and response["Error"].get("Code") == "NoSuchBucket"
