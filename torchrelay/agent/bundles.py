"""Job code bundles on this node: fetched once by digest, checked, cached, unpacked per launch.

Contract:
- ``BundleCache(directory, fetch)`` keeps ``<directory>/<sha256>.tar.gz``; ``fetch(digest)``
  returns a bundle's bytes (``ServerLink.fetch_bundle``).
- ``BundleCache.get(digest)``: the cached file, fetched if absent and refused (``ValueError``)
  unless its sha256 is ``digest``; one fetch at a time. Raises what ``fetch`` raises.
- ``BundleCache.unpack(digest, run_dir)``: ``run_dir/code``, unpacked from the bundle (empty for
  no bundle) by ``torchrelay.unpack.extract_bundle`` (nothing lands outside it; a refused member
  raises ``BundleRefused``, a ``ValueError`` naming it); idempotent (a marker
  says it is complete; a half-unpacked earlier try is removed first). Raises ``OSError``,
  ``tarfile.TarError``, ``ValueError`` and what ``fetch`` raises.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from torchrelay.unpack import extract_bundle


class BundleCache:
    def __init__(self, directory: Path, fetch: Callable[[str], bytes]):
        self.directory = Path(directory)
        self._fetch = fetch
        self._lock = threading.Lock()

    def path(self, digest: str) -> Path:
        return self.directory / f"{digest}.tar.gz"

    def get(self, digest: str) -> Path:
        """The bundle's cached file, downloaded (and checked against ``digest``) if absent."""
        if not digest or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise ValueError(f"bundle digest {digest!r} is not a sha256 hex string")
        path = self.path(digest)
        with self._lock:
            if path.exists():
                return path
            data = self._fetch(digest)
            actual = hashlib.sha256(data).hexdigest()
            if actual != digest.lower():
                raise ValueError(f"bundle {digest} arrived with sha256 {actual}; not using it")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return path

    def unpack(self, digest: str | None, run_dir: Path) -> Path:
        """The launch's code directory, unpacked from bundle ``digest`` (empty without one)."""
        code_dir = run_dir / "code"
        marker = run_dir / ".unpacked"
        if marker.exists():
            return code_dir
        if code_dir.exists():
            shutil.rmtree(code_dir)  # a half-unpacked earlier try
        code_dir.mkdir(parents=True)
        if digest:
            extract_bundle(self.get(digest), code_dir)
        marker.touch()
        return code_dir
