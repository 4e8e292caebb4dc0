"""S3 and S3-compatible stores (AWS, Ceph RGW, MinIO) through s3fs: no rename, conditional PUTs, a probe.

- An object store has no rename, and needs none: one PUT (or the completion of a multipart
  upload) makes the whole object visible at once. A writer that dies or raises before the end
  leaves the previous object as it was (``open_atomic_writer`` aborts its multipart upload on
  an error; a killed process leaves an unfinished upload that no reader sees, until the
  bucket's ``AbortIncompleteMultipartUpload`` lifecycle rule clears it).
- Conditional writes are PutObject with ``If-None-Match: *`` (create only) or ``If-Match:
  <etag>`` (compare-and-swap). s3fs passes both through ``pipe_file`` to botocore (its own
  ``mode="create"`` is the first), so no client code of our own is needed. Both go as one
  PUT, never a multipart upload: Ceph RGW 16.2 ignores ``If-None-Match`` on
  CompleteMultipartUpload. What the store honours is found by ``probe`` (Ceph RGW 16.2 answers
  412 to ``If-Match`` with the quoted ETag it handed out, and accepts it bare; a store that
  ignores the headers would accept every write), once per store, on the first conditional
  write or at ``check()``.
"""
from __future__ import annotations

import contextlib
import errno
import posixpath
import threading
import uuid
from typing import IO, Any, Iterator

from torchrelay.storage.backend import Backend, Versioned
from torchrelay.storage.conditional import (Capabilities, EtagForm, Guarantee, S3ProbeOutcome, etag_for_if_match,
                                            s3_capabilities)
from torchrelay.storage.failures import is_precondition_failed

SINGLE_PUT_LIMIT = 5 << 30  # S3's largest PutObject
# the part size of a whole-object write (``put_atomic``): objects from 64 MiB on go multipart in
# 32 MiB parts, sent concurrently (checkpoint files are at most 64 MiB, so the most are one PUT)
PART_BYTES = 32 << 20
PROBE_FOLDER = ".relay-probe"
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'


def _client_failures() -> tuple[type[BaseException], ...]:
    """The errors s3fs lets through untranslated: botocore's own (no endpoint, connection refused,
    timeouts, no credentials found) and aiohttp's."""
    found: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError
        found.append(BotoCoreError)
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError
        found.append(ClientError)
    return tuple(found)


class S3Backend(Backend):
    """One bucket (and prefix) of an S3 store; ``root`` is ``bucket[/prefix]`` (see the module docstring)."""

    def __init__(self, fs: Any, root: str):
        super().__init__(fs)
        self.failures = (OSError, *_client_failures())
        self.root = root
        self._capabilities: Capabilities | None = None
        self._probe_lock = threading.Lock()

    def capabilities(self) -> Capabilities:
        with self._probe_lock:
            if self._capabilities is None:
                self._capabilities = s3_capabilities(self.probe(self._probe_path()))
            return self._capabilities

    def _probe_path(self) -> str:
        return posixpath.join(self.root, PROBE_FOLDER, uuid.uuid4().hex)

    # ------------------------------------------------------------ whole-object writes

    def put_atomic(self, path: str, data: bytes) -> None:
        # one PUT below 2 parts; above, s3fs's multipart upload sends its parts concurrently
        # (``max_concurrency`` at once) and aborts the upload when one fails
        self.fs.pipe_file(path, data, chunksize=PART_BYTES)

    @contextlib.contextmanager
    def open_atomic_writer(self, path: str) -> Iterator[IO[bytes]]:
        fh = self.fs.open(path, "wb")
        try:
            yield fh
        except BaseException:
            with contextlib.suppress(Exception):
                fh.discard()  # aborts the multipart upload, if one was begun
            fh.closed = True  # close() would commit what was written so far
            raise
        fh.close()

    def delete_tree(self, path: str) -> None:
        # one listing, then one bulk delete per 1000 keys: exists() would be a HEAD and a listing
        # more, and rm(recursive=True) lists again (and, for a missing prefix, several times)
        keys = self.fs.find(path)
        if keys:
            self.fs.rm(keys)

    # ------------------------------------------------------------ conditional writes

    def put_if_absent(self, path: str, data: bytes) -> bool:
        if self.capabilities().put_if_absent is not Guarantee.ATOMIC:
            return super().put_if_absent(path, data)
        return self._conditional_put(path, data, IfNoneMatch="*")

    def read_versioned(self, path: str) -> Versioned | None:
        # HEAD, then GET: not one read, and it need not be. If the object changes in between,
        # the data is newer than the ETag, and the If-Match write that follows is refused.
        try:
            etag = self.fs.info(path, refresh=True)["ETag"]
            return Versioned(self.fs.cat_file(path), etag)
        except FileNotFoundError:
            return None

    def replace_if(self, path: str, data: bytes, expected: Versioned | None) -> bool:
        found = self.capabilities()
        if found.compare_and_swap is not Guarantee.ATOMIC or found.etag_form is None:
            return super().replace_if(path, data, expected)
        if expected is None:
            return self._conditional_put(path, data, IfNoneMatch="*")
        return self._conditional_put(path, data, IfMatch=etag_for_if_match(expected.version, found.etag_form))

    def _conditional_put(self, path: str, data: bytes, **condition: str) -> bool:
        """One PutObject under ``condition``; False when the store refuses it (412)."""
        if len(data) > SINGLE_PUT_LIMIT:
            raise OSError(errno.EFBIG, f"a conditional write takes one PUT, at most {SINGLE_PUT_LIMIT} bytes")
        try:
            # chunksize past the data's size: s3fs would otherwise go multipart, where RGW drops the condition
            self.fs.pipe_file(path, data, chunksize=SINGLE_PUT_LIMIT, **condition)
        except OSError as exc:
            if is_precondition_failed(exc):
                return False
            raise
        return True

    # ------------------------------------------------------------ probe

    def probe(self, path: str) -> S3ProbeOutcome:
        """Ask the store how it answers conditional PUTs, on a scratch object at ``path`` (deleted after)."""
        try:
            self.fs.pipe_file(path, b"probe")
            etag = self.fs.info(path, refresh=True)["ETag"]
            create_refused = not self._accepted(path, IfNoneMatch="*")
            wrong_refused = not self._accepted(path, IfMatch=_NO_SUCH_ETAG)
            quoted = self._accepted(path, IfMatch=etag_for_if_match(etag, EtagForm.QUOTED))
            # asked only when the quoted form failed: one request less on AWS and MinIO
            bare = not quoted and self._accepted(path, IfMatch=etag_for_if_match(etag, EtagForm.BARE))
        finally:
            self.remove_quietly(path)
        return S3ProbeOutcome(second_create_refused=create_refused, wrong_etag_refused=wrong_refused,
                              quoted_etag_accepted=quoted, bare_etag_accepted=bare)

    def _accepted(self, path: str, **condition: str) -> bool:
        # the same bytes every time: a write the store accepts leaves the ETag as it was
        return self._conditional_put(path, b"probe", **condition)

    def check(self, probe_path: str) -> None:
        """Probe anew (it writes and deletes an object: reach, credentials, bucket, permission)."""
        found = s3_capabilities(self.probe(probe_path))
        with self._probe_lock:
            self._capabilities = found
