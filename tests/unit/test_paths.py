"""The one path rule (torchrelay.paths): a table of names refused and names kept as they are."""
import pytest

from torchrelay.errors import InvalidPath
from torchrelay.paths import MAX_PATH_BYTES, MAX_SEGMENT_BYTES, path_problem, safe_digest, safe_relative_path

GOOD = ["model.pt", "a/b/c.txt", "tensorboard/rank-0/events.out.tfevents.1.host", "weights.safetensors",
        "..a", "a..", "a..b/c", ".hidden", "dir/.env", "100%", "50%_done.txt", "ünïcode/файл.bin",
        "x" * MAX_SEGMENT_BYTES, "/".join(["y" * 100] * 8), "space name.txt", "-dash", "~tilde"]

BAD = [
    ("", "empty"),
    ("..", "'..'"), (".", "'.'"), ("...", "'...'"), ("../x", "'..'"), ("a/../../b", "'..'"), ("a/..", "'..'"),
    ("./x", "'.'"), ("a/./b", "'.'"), ("....//", "'....'"),
    ("/etc/passwd", "absolute"), ("//proc/self/root/etc/passwd", "absolute"), ("/", "absolute"),
    ("a//b", "empty segment"), ("a/", "empty segment"),
    ("..\\x", "backslash"), ("a\\b", "backslash"), ("C:\\Windows", "backslash"),
    ("a\x00b", "control character"), ("a\nb", "control character"), ("a\x7fb", "control character"),
    ("x#../../y", "'#'"), ("a?b", "'?'"),
    ("%2e%2e/x", "'%2e'"), ("%2E%2E/x", "'%2E'"), ("..%2fx", "'%2f'"), ("a%2Fb", "'%2F'"),
    ("%252e%252e/x", "'%25'"), ("a%00b", "'%00'"), ("%5c", "'%5c'"),
    ("\uff0e\uff0e/x", "dots only"), ("\u2025/x", "dots only"), ("\u2024/x", "dots only"),
    ("a/\uff0e", "dots only"), ("\ufffd\ufffd/x", "U+FFFD"),
    ("x" * (MAX_SEGMENT_BYTES + 1), "longer than 255"), ("é" * 128, "longer than 255"),
    ("/".join(["y" * 200] * 5), f"longer than {MAX_PATH_BYTES}"),
]


@pytest.mark.parametrize("name", GOOD)
def test_plain_names_are_kept_as_they_are(name):
    assert safe_relative_path(name) == name and path_problem(name) is None


@pytest.mark.parametrize(("name", "why"), BAD)
def test_unsafe_names_are_refused_naming_the_path_and_what_is_allowed(name, why):
    with pytest.raises(InvalidPath) as caught:
        safe_relative_path(name, "artifact path")
    message = str(caught.value)
    assert message.startswith(f"artifact path {name!r} is refused: ")
    assert why in message and "allowed: a relative path" in message
    assert caught.value.http_status == 400


@pytest.mark.parametrize("value", [None, 3, b"model.pt", ["a"]])
def test_a_non_string_is_refused(value):
    with pytest.raises(InvalidPath, match="not a string"):
        safe_relative_path(value)


@pytest.mark.parametrize(("digest", "ok"), [
    ("a" * 64, True), ("0123456789abcdef" * 4, True),
    ("A" * 64, False), ("a" * 63, False), ("a" * 65, False), ("", False), ("g" * 64, False),
    ("../" + "a" * 61, False), ("a" * 64 + "\n", False), (None, False),
])
def test_a_bundle_digest_is_64_lowercase_hex(digest, ok):
    if ok:
        assert safe_digest(digest) == digest
    else:
        with pytest.raises(InvalidPath, match="64 lowercase hex"):
            safe_digest(digest)
