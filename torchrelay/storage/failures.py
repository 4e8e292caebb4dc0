"""What a store's failure says: a short cause for an ``OSError``, an S3 error's own reason, no secrets.

Pure: no I/O. ``describe_os_error`` turns an ``OSError`` (as fsspec raises them; s3fs chains the
botocore ``ClientError`` it translated as ``__cause__``) into a cause a user can act on;
``redact`` takes every secret it is given out of a text. Every message the store builds goes
through both, so a credential never reaches an error or a log.
"""
from __future__ import annotations

import errno
from typing import Iterable

REDACTED = "***"

# S3 error codes -> what they mean for the store, in the words a user looks for
_S3_REASONS = {
    "NoSuchBucket": "the bucket does not exist",
    "InvalidAccessKeyId": "the access key is not known to the store (check the credentials)",
    "SignatureDoesNotMatch": "the secret key does not match the access key (check the credentials)",
    "InvalidToken": "the session token is not valid (check the credentials)",
    "ExpiredToken": "the session token has expired (refresh the credentials)",
    "AccessDenied": "access denied (the credentials lack permission for this bucket or key)",
    "AllAccessDisabled": "access denied (all access to this bucket is disabled)",
    "PermanentRedirect": "the bucket is in another region (set the region)",
    "AuthorizationHeaderMalformed": "the region does not match the bucket's (set the region)",
    "PreconditionFailed": "a conditional write was refused (the object changed or exists)",
    "SlowDown": "the store asks to slow down (too many requests)",
    "NoSuchKey": "no such key",
}
# a HEAD answer carries no body, so no code: the HTTP status is all there is
_STATUS_REASONS = {403: "access denied (wrong credentials or no permission)", 404: "not found",
                   412: _S3_REASONS["PreconditionFailed"]}


def client_error_of(exc: BaseException | None) -> dict | None:
    """The ``response`` of the botocore ``ClientError`` behind ``exc`` (its cause chain), or None."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return response
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def s3_reason(code: str | None, status: int | None, message: str | None) -> str:
    """The cause of an S3 error answer: its meaning when the code is known, and the store's own words."""
    named = bool(code) and not code.isdigit()  # a HEAD answer's "code" is its status
    meaning = _S3_REASONS.get(code or "") if named else _STATUS_REASONS.get(status or 0)
    said = message if message and message not in ("None", code) else None
    parts = [p for p in (meaning, code if named else None, said) if p]
    if not parts:
        return f"HTTP {status}" if status else "unknown error"
    head, *rest = parts
    return f"{head} ({': '.join(rest)})" if rest else head


def is_precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a store's refusal of a conditional write (HTTP 412, or 409 for a lost race)."""
    if isinstance(exc, FileExistsError):
        return True
    response = client_error_of(exc)
    if response is None:
        return False
    code = response["Error"].get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or status == 412


def describe_os_error(exc: BaseException) -> str:
    """A short cause for ``exc``: disk full, permissions, the S3 answer, else its own text."""
    err = getattr(exc, "errno", None)
    if err == errno.ENOSPC:
        return "no space left on device"
    response = client_error_of(exc)
    if response is not None:
        error = response["Error"]
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return s3_reason(error.get("Code"), status, error.get("Message"))
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission denied (store is not writable)"
    return str(exc) or type(exc).__name__


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every non-empty secret in ``secrets`` replaced by ``***``."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text
