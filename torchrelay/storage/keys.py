"""Keys under a store's root: the one place that names where bundles, artifacts, checkpoints and fences lie.

Pure: no I/O. Layout::

    bundles/<sha256>.tar.gz                 code bundles, content addressed
    jobs/<job_id>/artifacts/<path>          files a job saved (models, results)
    jobs/<job_id>/checkpoints/<name>/...    checkpoints (see torchrelay.train.checkpoint)
    jobs/<job_id>/ATTEMPT                   the job's current attempt (decimal text): the fence

Every function raises ``StorageError`` for a value that would leave its folder.
"""
from __future__ import annotations

import posixpath

from torchrelay.errors import InvalidStoragePath

TEMP_MARK = ".tmp-"  # in the name of a file being written; listings skip it


def validate_relative_path(path: str) -> str:
    """``path`` normalised; raises ``InvalidStoragePath`` (a ``StorageError``) if it is absolute or climbs out ('..')."""
    norm = posixpath.normpath(path.replace("\\", "/")).lstrip("/") if path else ""
    if not norm or norm == "." or norm.startswith("..") or "/../" in f"/{norm}/" or path.startswith("/"):
        raise InvalidStoragePath(f"artifact path {path!r} must be relative and stay inside the job's folder")
    return norm


def bundle_key(digest: str) -> str:
    if not digest or not all(c in "0123456789abcdef" for c in digest) or len(digest) != 64:
        raise InvalidStoragePath(f"bundle digest {digest!r} is not a sha256 hex string")
    return f"bundles/{digest}.tar.gz"


def job_prefix(job_id: str) -> str:
    return f"jobs/{job_id}"


def artifact_key(job_id: str, path: str) -> str:
    return f"{job_prefix(job_id)}/artifacts/{validate_relative_path(path)}"


def attempt_key(job_id: str) -> str:
    return f"{job_prefix(job_id)}/ATTEMPT"


def checkpoint_prefix(job_id: str) -> str:
    return f"{job_prefix(job_id)}/checkpoints"


def relative_to(base: str, path: str) -> str:
    """``path`` (as a file system lists it) relative to ``base``; either may lack the leading '/'."""
    base, path = base.strip("/"), path.lstrip("/")
    return path[len(base):].lstrip("/") if path.startswith(base) else path
