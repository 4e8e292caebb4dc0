"""How writes are made whole on one kind of file system: the generic fsspec way, which the others refine.

``Backend`` works on any fsspec file system: a whole-file write goes to a temporary name in
the same folder and is renamed into place (``fs.mv``), so a reader never sees half a file;
conditional writes are a check followed by a write (``Guarantee.CHECK_THEN_WRITE``).
``LocalBackend`` (torchrelay.storage.local) and ``S3Backend`` (torchrelay.storage.s3) replace
what their file system can do better. Every method takes full paths (as ``fs`` names them) and
raises ``OSError`` as fsspec does (``FileNotFoundError`` for a missing path); the store turns
them into ``StorageError``/``NotFound``. Safe to share between threads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import posixpath
import uuid
from typing import IO, Any, Iterator

from torchrelay.storage.conditional import CHECK_THEN_WRITE_ONLY, Capabilities
from torchrelay.storage.keys import TEMP_MARK


@dataclasses.dataclass(frozen=True, slots=True)
class Versioned:
    """What a key held when it was read, and the token a compare-and-swap names it by."""

    data: bytes
    version: Any  # the bytes themselves, or an S3 ETag


def temp_name(path: str) -> str:
    """A fresh name beside ``path`` that listings skip."""
    return f"{path}{TEMP_MARK}{uuid.uuid4().hex[:8]}"


class Backend:
    """Whole-file writes and conditional writes on a generic fsspec file system (see the module docstring)."""

    def __init__(self, fs: Any):
        self.fs = fs
        # what this file system raises when the store fails: fsspec's OSErrors, and for a client
        # library that lets its own transport errors through (botocore), those too
        self.failures: tuple[type[BaseException], ...] = (OSError,)

    def capabilities(self) -> Capabilities:
        """What the conditional writes guarantee here. May probe the store (once)."""
        return CHECK_THEN_WRITE_ONLY

    # ------------------------------------------------------------ whole-file writes

    def put_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` so that a reader sees the old file or the new one, never a part."""
        with self.open_atomic_writer(path) as fh:
            fh.write(data)

    @contextlib.contextmanager
    def open_atomic_writer(self, path: str) -> Iterator[IO[bytes]]:
        """A file to write ``path`` through: it replaces ``path`` when the block ends, and is
        thrown away (``path`` untouched) when the block raises."""
        tmp = temp_name(path)
        try:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            with self.fs.open(tmp, "wb") as fh:
                yield fh
                self.sync(fh)
            self.fs.mv(tmp, path)
        except BaseException:
            self.remove_quietly(tmp)
            raise

    def sync(self, fh: IO[bytes]) -> None:
        """Make what was written to ``fh`` durable before it is renamed into place (no-op here)."""

    # ------------------------------------------------------------ conditional writes

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Write ``data`` at ``path`` unless something is there; True if written."""
        if self.fs.exists(path):
            return False
        self.put_atomic(path, data)
        return True

    def read_versioned(self, path: str) -> Versioned | None:
        """What ``path`` holds and its version; None when there is nothing."""
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return Versioned(data, data)

    def replace_if(self, path: str, data: bytes, expected: Versioned | None) -> bool:
        """Write ``data`` at ``path`` if it still holds ``expected`` (None: nothing); True if written."""
        current = self.read_versioned(path)
        if (current.version if current else None) != (expected.version if expected else None):
            return False
        self.put_atomic(path, data)
        return True

    # ------------------------------------------------------------ housekeeping

    def check(self, probe_path: str) -> None:
        """Prove the store can be reached and written: write ``probe_path`` and delete it."""
        self.put_atomic(probe_path, b"probe")
        self.fs.rm(probe_path)

    def delete_tree(self, path: str) -> None:
        """Delete ``path`` and everything below it; nothing when it is not there."""
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def remove_quietly(self, path: str) -> None:
        """Delete ``path`` if it is there, ignoring errors (cleanup after a failed write)."""
        try:
            if self.fs.exists(path):
                self.fs.rm(path)
        except OSError:
            pass
