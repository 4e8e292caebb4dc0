"""Local (and POSIX-mounted) folders: fsync'd whole-file writes, and conditional writes the kernel makes atomic.

- A whole-file write is fsync'd before it is renamed into place: a crash leaves the old file
  or the new one.
- ``put_if_absent`` writes a temporary file and ``link(2)``s it to the key: the link fails if
  the key exists, and the key only ever names a complete file.
- ``replace_if`` (the compare-and-swap under ``advance_fence``) holds an exclusive ``flock(2)``
  on ``<key>.tmp-lock`` while it reads, compares and renames. Atomic between processes of one
  host, and between hosts where the mount shares locks (NFSv4, CephFS); a mount whose locks
  are local to each host makes it a check-then-write across hosts.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from typing import IO, Iterator

from torchrelay.storage.backend import Backend, Versioned, temp_name
from torchrelay.storage.conditional import LOCAL_FILES, Capabilities
from torchrelay.storage.keys import TEMP_MARK


class LocalBackend(Backend):
    """A folder of this host's file system (see the module docstring)."""

    def capabilities(self) -> Capabilities:
        return LOCAL_FILES

    def sync(self, fh: IO[bytes]) -> None:
        fh.flush()
        os.fsync(fh.fileno())

    def put_if_absent(self, path: str, data: bytes) -> bool:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = temp_name(path)
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                self.sync(fh)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def replace_if(self, path: str, data: bytes, expected: Versioned | None) -> bool:
        with self._locked(path):
            return super().replace_if(path, data, expected)

    @contextlib.contextmanager
    def _locked(self, path: str) -> Iterator[None]:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}{TEMP_MARK}lock", "ab") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
            yield
