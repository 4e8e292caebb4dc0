"""Paths and payloads at the trust boundary, against real server processes over HTTP.

- A traversal corpus sent raw (no client library normalises it away) to artifact upload and
  download: every one refused, and the file system checked afterwards: nothing written outside
  the job's folder, sentinel files outside it unchanged and never served.
- Crafted bundles (``..`` members, absolute members, a symlink out then a file through it, a
  hard link out, a device node) unpacked by the agent's cache after a trip through the server:
  each refused naming the member, nothing outside the target, the sentinel unchanged.
- Size limits: over-limit bundle, artifact, log and metric batches get a 413 naming the limit
  and its setting (the SDK and the CLI show it as such); a 200 MB upload under a 1 GiB limit
  does not grow the server's peak RSS by anything like its size.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import bearer, group_members, kill_group
from logins import login_as_admin
from torchrelay.agent.bundles import BundleCache
from torchrelay.client.sdk import RelayClient
from torchrelay.errors import InvalidPath, PayloadTooLarge
from torchrelay.unpack import BundleRefused

SECRET = b"SENTINEL - must never change or be served"

# raw request-target fragments (sent as typed: percent-escapes stay as they are on the wire)
TRAVERSALS = [
    "..", "../x", "../../x", "..%2fx", "..%2F..%2Fx", "%2e%2e/x", "%2E%2E/%2E%2E/x", "%2e%2e%2fx", ".%2e/x",
    "%252e%252e/x", "%252e%252e%252fx", "..%252fx", "....//x", "..\\x", "..%5cx", "%5c..%5cx",
    "/etc/passwd", "//proc/self/root/etc/passwd", "a/../../b", "a/./b", "./x", "a//b", "a/",
    "a%00b", "x%23../../y", "a%3fb", "%EF%BC%8E%EF%BC%8E/x", "%E2%80%A5/x", "%C0%AE%C0%AE/x",
    "secret.txt/../../secret.txt", "%2e%2e/%2e%2e/%2e%2e/secret.txt", "x" * 300,
]


@contextlib.contextmanager
def relay_server(home: Path, config: dict | None = None):
    """A real `relay server --port 0` (with ``config`` as its --config file); yields (address, pid)."""
    from torchrelay.home import read_json, server_file

    home.mkdir(parents=True, exist_ok=True)
    args = []
    if config is not None:
        (home / "server.yaml").write_text(json.dumps(config))
        args = ["--config", str(home / "server.yaml")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RELAY_HOME": str(home)}
    env.pop("RELAY_ADDRESS", None)
    with open(home / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torchrelay.client.cli.main", "server", "--port", "0", *args],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while not ((info := read_json(server_file(home))) and info.get("pid") == proc.pid):
                assert proc.poll() is None, (home / "server.log").read_text()
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.05)
            login_as_admin(home, info["address"])
            yield info["address"], proc.pid
        finally:
            kill_group(proc.pid)
            proc.wait(timeout=10)
            assert group_members(proc.pid) == []


def raw_request(address: str, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 request whose target is sent byte for byte as given."""
    url = urlsplit(address)
    auth = "".join(f"{k}: {v}\r\n" for k, v in bearer(address).items())
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: {url.hostname}\r\nConnection: close\r\n{auth}"
                     f"Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), payload


def files_below(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A server with small limits: (address, home)."""
    home = tmp_path_factory.mktemp("limited") / "home"
    config = {"limits": {"bundle": "1MiB", "artifact": "1MiB", "log_batch": "64KiB", "metric_batch": "64KiB"}}
    with relay_server(home, config) as (address, _pid):
        yield address, home


def _new_job(address: str) -> str:
    with RelayClient(address) as c:
        return c.submit({"entrypoint": "python x.py"}, upload=False).id


def _plant_sentinels(home: Path, job_id: str) -> list[Path]:
    """Files a traversal from the job's artifact folder would reach: the store, the home, the other job."""
    store = home / "store"
    places = [store / "secret.txt", store / "jobs" / "secret.txt", store / "jobs" / job_id / "secret.txt",
              home / "secret.txt", home.parent / "secret.txt", store / "jobs" / "job-999" / "artifacts" / "x"]
    for place in places:
        place.parent.mkdir(parents=True, exist_ok=True)
        place.write_bytes(SECRET)
    return places


def test_traversal_corpus_is_refused_on_upload_and_download_and_nothing_escapes(limited):
    address, home = limited
    job_id = _new_job(address)
    sentinels = _plant_sentinels(home, job_id)
    outside_before = {p: p.read_bytes() for p in sentinels}
    root = home.parent
    before = {k: v for k, v in files_below(root).items() if not k.endswith(".log") and "state" not in k}
    statuses = {}
    for raw in TRAVERSALS:
        status, body = raw_request(address, "PUT", f"/api/v1/jobs/{job_id}/artifacts/{raw}", b"PWNED " + raw.encode())
        statuses[("PUT", raw)] = status
        assert status in (400, 404, 422), (raw, status, body)
        if status == 400:
            detail = json.loads(body)["detail"]
            assert "is refused" in detail and "allowed: a relative path" in detail, detail
        status, body = raw_request(address, "GET", f"/api/v1/jobs/{job_id}/artifacts/{raw}")
        statuses[("GET", raw)] = status
        assert status in (400, 404, 422), (raw, status, body)
        assert SECRET not in body
        status, body = raw_request(address, "GET", f"/api/v1/jobs/{job_id}/checkpoints/{raw}")
        assert status in (400, 404, 422) and SECRET not in body, (raw, status, body)
    assert sum(1 for s in statuses.values() if s == 400) >= len(TRAVERSALS)  # refused as bad paths, not "missing"
    # the file system, not only the status codes: no file anywhere changed or appeared
    for place, data in outside_before.items():
        assert place.read_bytes() == data
    after = {k: v for k, v in files_below(root).items() if not k.endswith(".log") and "state" not in k}
    assert {k: v for k, v in after.items() if b"PWNED" in v} == {}
    assert set(after) - set(before) == set()
    # a plain name still works, and lands in the job's folder
    assert raw_request(address, "PUT", f"/api/v1/jobs/{job_id}/artifacts/ok/model.bin", b"fine")[0] == 200
    assert (home / "store" / "jobs" / job_id / "artifacts" / "ok" / "model.bin").read_bytes() == b"fine"
    assert raw_request(address, "GET", f"/api/v1/jobs/{job_id}/artifacts/ok/model.bin") == (200, b"fine")


def test_bundle_digests_must_be_sha256_hex(limited):
    address, _home = limited
    for digest in ("A" * 64, "a" * 63, "%2e%2e", "..", "a" * 64 + "%00", "%252e%252e"):
        for method in ("GET", "HEAD"):
            status, body = raw_request(address, method, f"/api/v1/bundles/{digest}")
            assert status == 400 and (method == "HEAD" or b"64 lowercase hex" in body), (digest, status, body)
    for digest in ("..%2f..%2fsecret.txt", "../../secret.txt"):  # two segments: no such route at all
        status, body = raw_request(address, "GET", f"/api/v1/bundles/{digest}")
        assert status == 404 and SECRET not in body
    assert raw_request(address, "GET", f"/api/v1/bundles/{'a' * 64}")[0] == 404


def test_the_sdk_refuses_a_bad_path_with_a_clear_error(limited):
    address, _home = limited
    job_id = _new_job(address)
    with RelayClient(address) as c:
        with pytest.raises(InvalidPath, match=r"artifact path '%2e%2e/x' is refused: it holds the %-escape"):
            c.artifact_bytes(job_id, "%252e%252e/x")


# ------------------------------------------------------------------ bundles

def _tar(members) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return raw.getvalue()


def _file(name: str, data: bytes = b"PWNED") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _device(name: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    return info, None


def _bundles(outside: Path) -> dict[str, tuple[bytes, str]]:
    """Crafted bundles: name -> (tar.gz bytes, the member the refusal must name)."""
    return {
        "dotdot": (_tar([_file("ok.py", b"print(1)"), _file("../evil.txt")]), "../evil.txt"),
        "deep-dotdot": (_tar([_file("a/../../evil.txt")]), "a/../../evil.txt"),
        "absolute": (_tar([_file(str(outside / "abs-evil.txt"))]), str(outside / "abs-evil.txt")),
        "symlink-out-then-through": (_tar([_link("out", str(outside), tarfile.SYMTYPE), _file("out/evil.txt")]),
                                     "out"),
        "relative-symlink-out": (_tar([_link("up", "../..", tarfile.SYMTYPE), _file("up/evil.txt")]), "up"),
        "hardlink-out": (_tar([_link("hl", str(outside / "sentinel.txt"), tarfile.LNKTYPE),
                               _file("hl", b"PWNED through the hard link")]), "hl"),
        "device": (_tar([_device("null")]), "null"),
    }


def test_crafted_bundles_are_refused_after_a_trip_through_the_server(limited, tmp_path):
    address, home = limited
    outside = tmp_path / "outside"
    outside.mkdir()
    sentinel = outside / "sentinel.txt"
    sentinel.write_bytes(SECRET)
    for name, (blob, member) in _bundles(outside).items():
        digest = hashlib.sha256(blob).hexdigest()
        reply = httpx.post(f"{address}/api/v1/bundles", headers=bearer(address), content=blob)
        assert reply.status_code == 201 and reply.json()["digest"] == digest
        run_dir = tmp_path / "agent" / name
        cache = BundleCache(tmp_path / "agent-cache",
                            lambda d: httpx.get(f"{address}/api/v1/bundles/{d}", headers=bearer(address)).raise_for_status().content)
        with pytest.raises(BundleRefused) as caught:
            cache.unpack(digest, run_dir)
        message = str(caught.value)
        assert f"bundle member {member!r} is refused" in message, (name, message)
        assert "only plain files, folders and links that stay inside" in message
        # nothing outside the target: the outside folder holds only the sentinel, unchanged
        assert sorted(p.name for p in outside.iterdir()) == ["sentinel.txt"], name
        assert sentinel.read_bytes() == SECRET
        assert not (run_dir / "evil.txt").exists() and not (tmp_path / "agent" / "evil.txt").exists()
        assert not any(b"PWNED" in p.read_bytes() for p in tmp_path.rglob("*")
                       if p.is_file() and not p.is_symlink() and not p.name.endswith(".tar.gz")
                       and (run_dir / "code") not in p.parents), name
        for p in (run_dir / "code").rglob("*") if (run_dir / "code").exists() else ():
            assert not p.is_symlink() or (run_dir / "code") in p.resolve().parents, p
    assert files_below(home / "store" / "bundles")  # the server kept them as bytes, unpacked nothing


def test_a_plain_bundle_still_unpacks(tmp_path):
    blob = _tar([_file("train.py", b"print('hi')"), _link("same.py", "train.py", tarfile.SYMTYPE)])
    digest = hashlib.sha256(blob).hexdigest()
    code = BundleCache(tmp_path / "cache", lambda _d: blob).unpack(digest, tmp_path / "run")
    assert (code / "train.py").read_bytes() == b"print('hi')" and (code / "same.py").read_bytes() == b"print('hi')"


def test_a_refused_bundle_fails_the_launch_with_a_clear_message(cluster_factory, tmp_path):
    cluster = cluster_factory(agents=1)
    blob = _tar([_file("train.py", b"print(1)"), _file("../../../evil.txt")])
    digest = hashlib.sha256(blob).hexdigest()
    with RelayClient(cluster.address) as c:
        assert httpx.post(f"{cluster.address}/api/v1/bundles", headers=bearer(cluster.address), content=blob).status_code == 201
        job = c._request("POST", "/jobs", json={"spec": {"entrypoint": "python train.py", "max_restarts": 0},
                                                 "bundle": digest}).json()
        deadline = time.monotonic() + 60
        while (info := c.job(job["id"])).state not in ("FAILED", "SUCCEEDED"):
            assert time.monotonic() < deadline, info
            time.sleep(0.2)
        assert info.state == "FAILED"
        said = json.dumps(info.model_dump(mode="json"))
        assert "bundle member '../../../evil.txt' is refused" in said, said
        assert "Traceback" not in said
    assert list(tmp_path.rglob("evil.txt")) == []  # the agent's folders are below tmp_path too


# ------------------------------------------------------------------ size limits

def test_over_limit_uploads_get_413_naming_the_limit_and_setting(limited, tmp_path):
    address, home = limited
    job_id = _new_job(address)
    big = os.urandom(2 << 20)
    reply = httpx.put(f"{address}/api/v1/jobs/{job_id}/artifacts/big.bin", headers=bearer(address), content=big)
    assert reply.status_code == 413
    assert reply.json() == {"error": "PayloadTooLarge", "detail": (
        "the artifact of 2 MiB is over the server's limit of 1 MiB (1048576 bytes); the limits.artifact "
        "setting of the server config (relay server --config FILE) raises it")}

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    reply = httpx.put(f"{address}/api/v1/jobs/{job_id}/artifacts/big.bin", headers=bearer(address), content=chunks())
    assert reply.status_code == 413 and "limits.artifact" in reply.json()["detail"]
    assert not (home / "store" / "jobs" / job_id / "artifacts" / "big.bin").exists()

    logs = {"launch_id": "l", "records": [{"rank": 0, "seq": i, "text": "x" * 1000} for i in range(100)]}
    reply = httpx.post(f"{address}/api/v1/jobs/{job_id}/logs", headers=bearer(address), json=logs)
    assert reply.status_code == 413 and "over the server's limit of 64 KiB" in reply.json()["detail"]
    assert "limits.log_batch" in reply.json()["detail"]
    metrics = {"launch_id": "l", "records": [{"rank": 0, "seq": i, "step": i, "time": 0.0,
                                              "values": {f"k{j}": 1.0 for j in range(100)}} for i in range(100)]}
    reply = httpx.post(f"{address}/api/v1/jobs/{job_id}/metrics", headers=bearer(address), json=metrics)
    assert reply.status_code == 413 and "limits.metric_batch" in reply.json()["detail"]
    small = {"launch_id": "l", "records": [{"rank": 0, "seq": 1, "text": "fits"}]}
    assert httpx.post(f"{address}/api/v1/jobs/{job_id}/logs", headers=bearer(address), json=small).status_code == 200

    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print(1)\n")
    (work / "data.bin").write_bytes(os.urandom(3 << 20))
    with RelayClient(address) as c:
        with pytest.raises(PayloadTooLarge, match=r"the bundle of 3(\.\d+)? MiB is over the server's limit of 1 MiB .*"
                                                  r"limits\.bundle setting of the server config"):
            c.upload_bundle(work)
    (work / "job.yaml").write_text("entrypoint: python train.py\n")
    cli = subprocess.run([sys.executable, "-m", "torchrelay.client.cli.main", "submit", str(work / "job.yaml")],
                         env={**os.environ, "RELAY_ADDRESS": address}, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1, cli
    assert "limits.bundle" in cli.stdout + cli.stderr and "Traceback" not in cli.stdout + cli.stderr


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_200_MB_upload_is_streamed_not_held_in_memory(tmp_path):
    size = 200 * 2**20
    block = os.urandom(1 << 20)
    expected = hashlib.sha256(block * (size // len(block))).hexdigest()

    def body():
        for _ in range(size // len(block)):
            yield block
    config = {"limits": {"artifact": "1GiB", "bundle": "1GiB"}}
    with relay_server(tmp_path / "home", config) as (address, pid):
        job_id = _new_job(address)
        # warm every path first (imports, thread pool), so what is left to grow is the upload
        assert httpx.put(f"{address}/api/v1/jobs/{job_id}/artifacts/warm.bin", headers=bearer(address), content=block).status_code == 200
        assert httpx.post(f"{address}/api/v1/bundles", headers=bearer(address), content=block).status_code == 201
        before = _peak_rss(pid)
        reply = httpx.put(f"{address}/api/v1/jobs/{job_id}/artifacts/big.bin", headers=bearer(address), content=body(), timeout=300)
        assert reply.status_code == 200 and reply.json()["size"] == size
        reply = httpx.post(f"{address}/api/v1/bundles", headers=bearer(address), content=body(), timeout=300)
        assert reply.status_code == 201 and reply.json() == {"digest": expected, "size": size}
        grown = _peak_rss(pid) - before
        stored = tmp_path / "home" / "store" / "jobs" / job_id / "artifacts" / "big.bin"
        assert stored.stat().st_size == size
        on_disk = hashlib.sha256()
        with open(stored, "rb") as fh:
            while chunk := fh.read(1 << 20):
                on_disk.update(chunk)
        assert on_disk.hexdigest() == expected
        with httpx.stream("GET", f"{address}/api/v1/jobs/{job_id}/artifacts/big.bin", headers=bearer(address), timeout=300) as resp:
            digest = hashlib.sha256()
            for chunk in resp.iter_bytes(1 << 20):
                digest.update(chunk)
        assert digest.hexdigest() == expected
        grown = max(grown, _peak_rss(pid) - before)
    assert grown < size // 4, f"the server's peak RSS grew by {grown / 2**20:.0f} MiB for a 200 MiB body"
