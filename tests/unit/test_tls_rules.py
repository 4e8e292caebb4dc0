"""torchrelay.tls: which CA a client trusts, and what a TLS failure says (no network)."""
from __future__ import annotations

import os
import ssl
from pathlib import Path

import httpx
import pytest

from torchrelay.agent.commands import build_worker_env
from torchrelay.errors import InvalidSpec, UntrustedServer
from torchrelay.tls import configured_ca, plain_to_tls_hint, tls_failure, verify_for
from torchrelay.wire import LaunchAssignment


@pytest.mark.parametrize("explicit, env, expected", [
    (None, {}, None),
    (None, {"RELAY_CA": ""}, None),
    (None, {"RELAY_CA": "/etc/ca.pem"}, "/etc/ca.pem"),
    ("/opt/mine.pem", {"RELAY_CA": "/etc/ca.pem"}, "/opt/mine.pem"),
    ("rel/ca.pem", {}, os.path.abspath("rel/ca.pem")),
    (None, {"RELAY_CA": "rel/ca.pem"}, os.path.abspath("rel/ca.pem")),
])
def test_configured_ca(explicit, env, expected):
    assert configured_ca(explicit, env) == expected


def test_plain_http_needs_no_verification(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAY_CA", str(tmp_path / "absent.pem"))  # not even read for http://
    assert verify_for("http://127.0.0.1:8470") is True
    assert verify_for("http://a:1,http://b:1") is True


def test_https_verifies_against_the_system_cas_by_default(monkeypatch):
    monkeypatch.delenv("RELAY_CA", raising=False)
    context = verify_for("https://relay.example:8470")
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


@pytest.mark.parametrize("content, origin", [(None, "--ca"), ("not a certificate\n", "--ca"),
                                             (None, "RELAY_CA (relay --ca)")])
def test_a_ca_file_that_does_not_load_is_named(tmp_path, monkeypatch, content, origin):
    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_text(content)
    if origin.startswith("RELAY_CA"):
        monkeypatch.setenv("RELAY_CA", str(path))
    with pytest.raises(InvalidSpec) as refused:
        verify_for("https://127.0.0.1:1", path if origin == "--ca" else None)
    assert f"{origin} '{path}'" in str(refused.value)


def _wrapped(cause: BaseException) -> httpx.ConnectError:
    """An httpx error whose context chain holds ``cause``, as httpx raises them."""
    try:
        try:
            raise cause
        except BaseException as inner:
            raise httpx.ConnectError(str(inner)) from inner
    except httpx.ConnectError as exc:
        return exc


def _verify_error() -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    exc.verify_message = "unable to get local issuer certificate"
    return exc


@pytest.mark.parametrize("cause, ca, says", [
    (_verify_error(), None, ["does not verify (unable to get local issuer certificate)", "system's CAs",
                             "--ca FILE or RELAY_CA=FILE"]),
    (_verify_error(), "/etc/mine.pem", ["trusting /etc/mine.pem", "--ca FILE"]),
    (ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number"), None,
     ["no TLS handshake", "its address is http://", "RELAY_CA"]),
])
def test_tls_failures_say_what_to_do(cause, ca, says):
    found = tls_failure(_wrapped(cause), "https://10.0.0.1:8470", ca)
    assert isinstance(found, UntrustedServer)
    assert "https://10.0.0.1:8470" in str(found)
    for part in says:
        assert part in str(found), found


@pytest.mark.parametrize("cause", [ConnectionRefusedError(111, "Connection refused"), OSError("no route")])
def test_other_failures_are_not_tls_ones(cause):
    assert tls_failure(_wrapped(cause), "https://10.0.0.1:8470") is None


@pytest.mark.parametrize("address, hint", [
    ("http://10.0.0.1:8470", "its address is https://10.0.0.1:8470"),
    ("https://10.0.0.1:8470", ""),
])
def test_plain_to_tls_hint(address, hint):
    assert hint in plain_to_tls_hint(address)
    assert bool(plain_to_tls_hint(address)) == bool(hint)


@pytest.mark.parametrize("agent_ca, job_ca, expected", [
    (None, None, None),
    ("/etc/relay/ca.pem", None, "/etc/relay/ca.pem"),
    ("/etc/relay/ca.pem", "/tmp/job.pem", "/etc/relay/ca.pem"),  # the agent's wins over a job's
    (None, "/tmp/job.pem", None),
])
def test_workers_get_the_agents_ca(tmp_path: Path, agent_ca, job_ca, expected):
    assignment = LaunchAssignment(launch_id="l-1", job_id="job-1", attempt=1, desired="run", node_rank=0, nnodes=1,
                                  nproc_per_node=1, world_size=1, rank_offset=0, entrypoint=["python", "t.py"],
                                  bundle=None, env={"RELAY_CA": job_ca} if job_ca else {}, store_url="file:///s",
                                  job_store_prefix="jobs/job-1")
    base = {"RELAY_CA": agent_ca} if agent_ca else {}
    env = build_worker_env(assignment, base_env=base, run_dir=tmp_path, relay_address="https://s:1")
    assert env.get("RELAY_CA") == expected
