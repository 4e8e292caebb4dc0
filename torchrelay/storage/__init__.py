"""Artifact store over fsspec: the only place that builds storage paths.

Layout under the store root (a local directory, ``s3://bucket/prefix``, ``hdfs://…``):

    bundles/<sha256>.tar.gz                 code bundles, content addressed
    jobs/<job_id>/artifacts/<path>          files a job saved (models, results)
    jobs/<job_id>/checkpoints/<name>/...    checkpoints (see torchrelay.train.checkpoint)
    jobs/<job_id>/ATTEMPT                   the job's current attempt, written by the server when
                                            it places one: the fence checkpoint commits check

Contract: writes of whole files go to a temporary name and are renamed into place, so a
reader never sees half a file; every method raises ``StorageError`` naming the path and the
cause (full disk, permissions) and ``NotFound`` for a missing path.
"""
from __future__ import annotations

import errno
import os
import posixpath
import uuid
from typing import Iterator

import fsspec

from torchrelay.errors import NotFound, StorageError


def validate_relative_path(path: str) -> str:
    """``path`` normalised; raises ``StorageError`` if it is absolute or climbs out ('..')."""
    norm = posixpath.normpath(path.replace("\\", "/")).lstrip("/") if path else ""
    if not norm or norm == "." or norm.startswith("..") or "/../" in f"/{norm}/" or path.startswith("/"):
        raise StorageError(f"artifact path {path!r} must be relative and stay inside the job's folder")
    return norm


class ArtifactStore:
    """A store rooted at ``url``. Safe to share between threads (fsspec file systems are)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/") if url not in ("/",) else url
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self._local = self.fs.protocol in ("file", ("file", "local")) or "file" in tuple(
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        if self._local:
            os.makedirs(self.root, exist_ok=True)

    # ------------------------------------------------------------ paths

    @staticmethod
    def bundle_key(digest: str) -> str:
        if not digest or not all(c in "0123456789abcdef" for c in digest) or len(digest) != 64:
            raise StorageError(f"bundle digest {digest!r} is not a sha256 hex string")
        return f"bundles/{digest}.tar.gz"

    @staticmethod
    def job_prefix(job_id: str) -> str:
        return f"jobs/{job_id}"

    @classmethod
    def artifact_key(cls, job_id: str, path: str) -> str:
        return f"{cls.job_prefix(job_id)}/artifacts/{validate_relative_path(path)}"

    @classmethod
    def attempt_key(cls, job_id: str) -> str:
        return f"{cls.job_prefix(job_id)}/ATTEMPT"

    @classmethod
    def checkpoint_prefix(cls, job_id: str) -> str:
        return f"{cls.job_prefix(job_id)}/checkpoints"

    def full_path(self, key: str) -> str:
        """Path of ``key`` as the file system of this store names it."""
        return posixpath.join(self.root, key) if self.root else key

    def url_of(self, key: str) -> str:
        """fsspec URL of ``key`` (what a worker on another host can open)."""
        return f"{self.url}/{key}"

    # ------------------------------------------------------------ bytes

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` atomically (temp name + rename). Raises ``StorageError``."""
        path = self.full_path(key)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            with self.fs.open(tmp, "wb") as fh:
                fh.write(data)
                if self._local:
                    fh.flush()
                    os.fsync(fh.fileno())
            self.fs.mv(tmp, path)
        except OSError as exc:
            self._cleanup(tmp)
            raise StorageError(f"cannot write {self.url_of(key)}: {_describe(exc)}") from exc

    def get_bytes(self, key: str) -> bytes:
        try:
            with self.fs.open(self.full_path(key), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            raise NotFound(f"no artifact at {self.url_of(key)}") from None
        except OSError as exc:
            raise StorageError(f"cannot read {self.url_of(key)}: {_describe(exc)}") from exc

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.full_path(key))

    def size(self, key: str) -> int:
        try:
            return int(self.fs.size(self.full_path(key)))
        except FileNotFoundError:
            raise NotFound(f"no artifact at {self.url_of(key)}") from None

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key relative to ``prefix``, size) of every file below ``prefix``, sorted; skips temp files."""
        base = self.full_path(prefix).rstrip("/")
        if not self.fs.exists(base):
            return iter(())
        found = self.fs.find(base, detail=True)
        out = []
        for path, info in found.items():
            rel = path[len(base.lstrip("/")) if not path.startswith(base) else len(base):].lstrip("/")
            if ".tmp-" in rel:
                continue
            out.append((rel, int(info.get("size") or 0)))
        return iter(sorted(out))

    def delete_prefix(self, prefix: str) -> None:
        path = self.full_path(prefix)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def _cleanup(self, path: str) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path)
        except OSError:
            pass


def _describe(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on device"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission denied (store is not writable)"
    return str(exc)
