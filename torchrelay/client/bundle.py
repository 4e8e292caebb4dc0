"""Pack a job's working directory into a reproducible tar.gz (the code bundle).

Contract: the same files give the same bytes (sorted entries, zeroed times and owners), so the
sha256 names the content and agents cache by it. Left out: version-control and virtual-env
folders, caches, and every pattern in a ``.relayignore`` file (fnmatch, one per line).
Raises ``InvalidSpec`` when the folder is missing or the bundle would exceed ``max_bytes``.
"""
from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import tarfile
from pathlib import Path

from torchrelay.errors import InvalidSpec
from torchrelay.unpack import extract_bundle

DEFAULT_IGNORES = (".git", ".hg", ".svn", ".venv", "venv", "__pycache__", "*.pyc", ".pytest_cache",
                   ".mypy_cache", "node_modules", "relay-outputs", ".ipynb_checkpoints", "*.egg-info")
MAX_BUNDLE_BYTES = 256 * 2**20


def _ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    return any(fnmatch.fnmatch(part, pat) for part in parts for pat in patterns) or any(
        fnmatch.fnmatch(rel, pat) for pat in patterns)


def pack_dir(root: str | Path, max_bytes: int = MAX_BUNDLE_BYTES) -> tuple[bytes, str]:
    """(tar.gz bytes, sha256 hex) of ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise InvalidSpec(f"workdir {str(root)!r} is not a directory")
    patterns = list(DEFAULT_IGNORES)
    ignore_file = root / ".relayignore"
    if ignore_file.is_file():
        patterns += [ln.strip().rstrip("/") for ln in ignore_file.read_text().splitlines()
                     if ln.strip() and not ln.startswith("#")]
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        dirnames[:] = sorted(d for d in dirnames if not _ignored(f"{rel_dir}/{d}".lstrip("/"), patterns))
        for name in filenames:
            rel = f"{rel_dir}/{name}".lstrip("/")
            if not _ignored(rel, patterns) and os.path.isfile(os.path.join(dirpath, name)):
                files.append(rel)
    raw = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(files):
            path = root / rel
            data = path.read_bytes()
            total += len(data)
            if total > max_bytes:
                raise InvalidSpec(f"workdir {str(root)!r} holds more than {max_bytes // 2**20} MiB of files "
                                  f"(at {rel!r}); list data folders in .relayignore and read data from the store")
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=6) as gz:
        gz.write(raw.getvalue())
    blob = out.getvalue()
    return blob, hashlib.sha256(blob).hexdigest()


def unpack(blob: bytes, dest: str | Path) -> None:
    """Extract a bundle into ``dest``; refuses members that would land outside it (``BundleRefused``)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    extract_bundle(io.BytesIO(blob), dest)
