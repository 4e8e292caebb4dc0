"""Keys under a store's root: the one place that names where bundles, artifacts, checkpoints and fences lie.

Pure: no I/O. Layout::

    bundles/<sha256>.tar.gz                 code bundles, content addressed
    jobs/<job_id>/artifacts/<path>          files a job saved (models, results)
    jobs/<job_id>/checkpoints/<name>/...    checkpoints (see torchrelay.train.checkpoint)
    jobs/<job_id>/ATTEMPT                   the job's current attempt (decimal text): the fence

Every function raises ``InvalidPath`` (HTTP 400) for a value that would leave its folder or is
not a plain name: the rule is ``torchrelay.paths``.
"""
from __future__ import annotations

from torchrelay.errors import InvalidPath
from torchrelay.paths import safe_digest, safe_relative_path

TEMP_MARK = ".tmp-"  # in the name of a file being written; listings skip it


def validate_relative_path(path: str, what: str = "artifact path") -> str:
    """``path`` unchanged if it is a plain relative path that stays in its folder; raises
    ``InvalidPath`` otherwise (the rule is ``torchrelay.paths.safe_relative_path``)."""
    return safe_relative_path(path, what)


def bundle_key(digest: str) -> str:
    return f"bundles/{safe_digest(digest)}.tar.gz"


def job_prefix(job_id: str) -> str:
    if "/" in str(job_id):
        raise InvalidPath(f"job id {job_id!r} is refused: a job id is one name (job-N), without '/'")
    return f"jobs/{safe_relative_path(job_id, 'job id')}"


def artifact_key(job_id: str, path: str) -> str:
    return f"{job_prefix(job_id)}/artifacts/{validate_relative_path(path)}"


def checkpoint_file_key(job_id: str, path: str) -> str:
    """Where the file ``path`` (relative to the job's checkpoint folder) lies."""
    return f"{checkpoint_prefix(job_id)}/{validate_relative_path(path, 'checkpoint path')}"


def attempt_key(job_id: str) -> str:
    return f"{job_prefix(job_id)}/ATTEMPT"


def checkpoint_prefix(job_id: str) -> str:
    return f"{job_prefix(job_id)}/checkpoints"


def relative_to(base: str, path: str) -> str:
    """``path`` (as a file system lists it) relative to ``base``; either may lack the leading '/'."""
    base, path = base.strip("/"), path.lstrip("/")
    return path[len(base):].lstrip("/") if path.startswith(base) else path
