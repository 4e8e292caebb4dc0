"""The one rule for names a request, a job spec or a worker gives to the store: a plain relative path.

Pure: no I/O. ``safe_relative_path(raw, what)`` returns ``raw`` unchanged when it is a safe path
below a job's folder, else raises ``InvalidPath`` naming the value, what is wrong and what is
allowed. Nothing is normalised or repaired: a name that needs fixing is refused, so the name the
store keeps is the name the caller gave.

Allowed: segments separated by single ``/``; each segment 1 to ``MAX_SEGMENT_BYTES`` bytes of
UTF-8 and the whole at most ``MAX_PATH_BYTES`` (the S3 key limit, less room for the job's prefix).
Refused: an empty path, a leading ``/`` (absolute), empty segments (``//``, a trailing ``/``),
``.`` and ``..`` segments and any segment of dots only (also Unicode dots that NFKC folds to
``.``: ``．``, ``‥``, ``․``), backslashes, NUL and other control characters, ``#`` and ``?``
(URL fragment and query), U+FFFD (what bytes that are not UTF-8, like ``%C0%AE``, decode to),
and percent-escapes (``%2e``, ``%2f``, ``%252e``...): a path arrives decoded once by the HTTP
server, so an escape left in it is an attempt to be decoded again.

``safe_digest(raw)``: a bundle's name, exactly 64 lowercase hex characters (sha256).
"""
from __future__ import annotations

import re
import unicodedata

from torchrelay.errors import InvalidPath

MAX_SEGMENT_BYTES = 255
MAX_PATH_BYTES = 900

ALLOWED = ("allowed: a relative path of '/'-separated names (1 to 255 bytes each, 900 in all) without "
           "'..' or '.' segments, empty segments, a leading '/', backslashes, control characters, "
           "'#', '?' or %-escapes")

_PERCENT_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def safe_relative_path(raw: object, what: str = "artifact path") -> str:
    """``raw`` if it is a safe relative path (see the module docstring). Raises ``InvalidPath``."""
    problem = path_problem(raw)
    if problem:
        raise InvalidPath(f"{what} {raw!r} is refused: {problem}; {ALLOWED}")
    return raw  # type: ignore[return-value]  # path_problem proved it is a str


def path_problem(raw: object) -> str | None:
    """What makes ``raw`` unsafe, in a few words; None when it is safe."""
    if not isinstance(raw, str):
        return f"it is a {type(raw).__name__}, not a string"
    if not raw:
        return "it is empty"
    if _CONTROL.search(raw):
        return "it holds a control character (NUL, newline...)"
    for char, why in (("\\", "a backslash"), ("#", "'#'"), ("?", "'?'"),
                      ("\ufffd", "U+FFFD (bytes that were not UTF-8)")):
        if char in raw:
            return f"it holds {why}"
    if _PERCENT_ESCAPE.search(raw):
        return f"it holds the %-escape {_PERCENT_ESCAPE.search(raw).group(0)!r}"  # type: ignore[union-attr]
    if raw.startswith("/"):
        return "it is absolute (starts with '/')"
    if len(raw.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"it is longer than {MAX_PATH_BYTES} bytes"
    for segment in raw.split("/"):
        problem = _segment_problem(segment)
        if problem:
            return problem
    return None


def _segment_problem(segment: str) -> str | None:
    if not segment:
        return "it has an empty segment ('//' or a trailing '/')"
    if len(segment.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES:
        return f"its segment {segment[:40]!r}... is longer than {MAX_SEGMENT_BYTES} bytes"
    folded = unicodedata.normalize("NFKC", segment)
    if set(folded) <= {"."}:
        return f"it has the segment {segment!r} (dots only: '.' and '..' would move out of place)"
    return None


def safe_digest(raw: object) -> str:
    """``raw`` if it is a sha256 in lowercase hex (a bundle's name). Raises ``InvalidPath``."""
    if not isinstance(raw, str) or not _DIGEST.fullmatch(raw):
        raise InvalidPath(f"bundle digest {raw!r} is refused: a bundle is named by its sha256, "
                          "64 lowercase hex characters")
    return raw
