"""HDFS through WebHDFS (fsspec's own client): writes made whole by rename, create-if-absent by rename.

HDFS has a rename, but one that never replaces: renaming onto an existing file answers
``{"boolean": false}`` and changes nothing (fsspec's ``mv`` drops that answer, so it is read
here from the ``RENAME`` call itself). Hence:
- a whole-file write goes to a temp name beside the target and is renamed into place; when the
  target exists it is deleted first, so a reader between the two finds no file (never a part);
- ``put_if_absent`` writes a temp file and renames it: the rename fails when the target exists,
  so this is one atomic operation of the namenode (``Guarantee.ATOMIC``);
- a compare-and-swap (the fence) has no such operation: a read, then a write
  (``Guarantee.CHECK_THEN_WRITE``).
fsspec's WebHDFS client raises ``RuntimeError`` for HDFS exceptions it does not map (such as
``FileAlreadyExistsException``): they are turned into ``OSError`` at the client's one call
(``_call``), so they are store failures while a caller's own ``RuntimeError`` stays its own. ``hdfs://`` (pyarrow's
``HadoopFileSystem`` or ``hdfs-native``) uses the generic backend (torchrelay.storage.backend).
"""
from __future__ import annotations

import contextlib
import errno
import posixpath
from typing import IO, Any, Iterator

from torchrelay.storage.backend import Backend, temp_name
from torchrelay.storage.conditional import Capabilities, Guarantee

WEBHDFS = Capabilities(put_if_absent=Guarantee.ATOMIC, compare_and_swap=Guarantee.CHECK_THEN_WRITE)


class WebHdfsBackend(Backend):
    def __init__(self, fs: Any):
        super().__init__(fs)
        _raise_os_errors(fs)

    def capabilities(self) -> Capabilities:
        return WEBHDFS

    def _rename(self, source: str, target: str) -> bool:
        """HDFS's rename: False (nothing changed) when ``target`` exists."""
        answer = self.fs._call("RENAME", method="put", path=source, destination=target)
        return bool(answer.json().get("boolean"))

    @contextlib.contextmanager
    def open_atomic_writer(self, path: str) -> Iterator[IO[bytes]]:
        tmp = temp_name(path)
        try:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            with self.fs.open(tmp, "wb") as fh:
                yield fh
            if not self._rename(tmp, path):
                self.fs.rm(path)  # HDFS's rename never replaces: the old file goes first
                if not self._rename(tmp, path):
                    raise OSError(errno.EEXIST, f"{path} was written by another writer meanwhile")
        except BaseException:
            self.remove_quietly(tmp)
            raise

    def put_if_absent(self, path: str, data: bytes) -> bool:
        tmp = temp_name(path)
        try:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            with self.fs.open(tmp, "wb") as fh:
                fh.write(data)
            return self._rename(tmp, path)
        finally:
            self.remove_quietly(tmp)


def _raise_os_errors(fs: Any) -> None:
    """Make ``fs``'s WebHDFS calls raise ``OSError`` where fsspec raises ``RuntimeError``. Idempotent."""
    if getattr(fs, "_relay_os_errors", False):
        return
    call = fs._call

    def _call(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except RuntimeError as exc:  # an HDFS exception fsspec does not map (FileAlreadyExists…)
            raise OSError(errno.EIO, str(exc)) from exc

    fs._call = _call
    fs._relay_os_errors = True
