"""HTTPS on the control plane: a server with a certificate from a CA the test makes (trustme), on
127.0.0.1, reached by the SDK, the `relay` CLI, an agent and the agent's workers, each verifying
it; a client that does not trust the CA, or that speaks plain HTTP to the TLS port, is refused
with a line that says what to do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import group_members, kill_group, serving
from torchrelay.client.cluster import ServerTls
from torchrelay.client.sdk import RelayClient
from torchrelay.errors import InvalidSpec, ServerUnavailable, UntrustedServer
from torchrelay.spec import JobState

trustme = pytest.importorskip("trustme", reason="trustme is not installed (pip install -e .[test])")
pytestmark = pytest.mark.timeout(240)
CLI = [sys.executable, "-m", "torchrelay.client.cli.main"]

WORKER = textwrap.dedent("""\
    import os
    import torchrelay.train as rt
    from torchrelay.client.sdk import RelayClient

    ctx = rt.init()
    for step in range(3):
        rt.report(step, loss=1.0 / (step + 1))
    rt.save_artifact("result.txt", b"trained over https")
    with RelayClient() as client:  # RELAY_ADDRESS and RELAY_CA come from the agent
        print("worker sees", client.job(os.environ["RELAY_JOB_ID"]).state.value, "via", client.address)
    print("worker CA", os.environ.get("RELAY_CA"))
    rt.shutdown()
    """)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The CA's PEM, the server's certificate chain and key (for 127.0.0.1 and localhost), and a
    second CA that signed nothing of this server's."""
    folder = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    files = {"ca": folder / "ca.pem", "other": folder / "other-ca.pem", "cert": folder / "server.pem",
             "key": folder / "server.key"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    other.cert_pem.write_to_path(str(files["other"]))
    leaf.private_key_pem.write_to_path(str(files["key"]))
    for blob in leaf.cert_chain_pems:
        blob.write_to_path(str(files["cert"]), append=True)
    return files


@pytest.fixture
def tls_server(relay_home, pki, monkeypatch):
    monkeypatch.delenv("RELAY_CA", raising=False)
    with serving(relay_home, ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])]) as address:
        yield address


def cli(*args: str, address: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    full = {k: v for k, v in os.environ.items() if k != "RELAY_CA"}
    return subprocess.run([*CLI, *args], env={**full, "RELAY_ADDRESS": address, "COLUMNS": "200", **(env or {})},
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def test_a_job_runs_over_https_from_client_to_agent_to_worker(cluster_factory, pki, tmp_path, monkeypatch):
    """The SDK submits, waits, reads logs and metrics and downloads; the agent registers and
    ships logs and metrics; the worker saves an artifact and calls the server itself."""
    monkeypatch.delenv("RELAY_CA", raising=False)
    cluster = cluster_factory(1, tls=ServerTls(cert=pki["cert"], key=pki["key"], ca=pki["ca"]))
    assert cluster.address.startswith("https://127.0.0.1:")
    work = tmp_path / "job"
    work.mkdir()
    (work / "train.py").write_text(WORKER)
    with RelayClient(cluster.address, ca=pki["ca"]) as client:
        assert [n.state for n in client.nodes()] == ["READY"]  # the agent registered over HTTPS
        info = client.submit({"name": "tls", "entrypoint": "python train.py", "workers": 1}, base_dir=work)
        final = client.wait(info.id, timeout=120)
        texts = [line.text for line in client.follow_logs(info.id)]  # the SSE stream, over HTTPS
        assert final.state == JobState.SUCCEEDED, (final, texts)
        assert f"worker sees RUNNING via {cluster.address}" in texts
        assert f"worker CA {pki['ca'].resolve()}" in texts
        assert [(p.step, p.values["loss"]) for p in client.iter_metrics(info.id)] == [(0, 1.0), (1, 0.5),
                                                                                        (2, 1.0 / 3)]
        written = client.download(info.id, tmp_path / "out")
        # The server's TensorBoard exporter may have written its event file as an artifact too.
        relative = [p.relative_to((tmp_path / "out").resolve()).as_posix() for p in written]
        assert [path for path in relative if not path.startswith("tensorboard/")] == ["result.txt"]
        assert (tmp_path / "out" / "result.txt").read_bytes() == b"trained over https"

    listed = cli("--ca", str(pki["ca"]), "ls", "-o", "json", address=cluster.address)
    assert listed.returncode == 0, listed.stderr
    assert [job["id"] for job in json.loads(listed.stdout)] == [info.id]
    logs = cli("logs", info.id, address=cluster.address, env={"RELAY_CA": str(pki["ca"])})
    assert logs.returncode == 0 and "worker CA" in logs.stdout, logs.stderr
    fetched = cli("--ca", str(pki["ca"]), "download", info.id, str(tmp_path / "cli-out"), address=cluster.address)
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "cli-out" / "result.txt").read_bytes() == b"trained over https"


@pytest.mark.parametrize("trust", ["none", "other"])
def test_a_client_that_does_not_trust_the_ca_is_refused_clearly(tls_server, pki, trust):
    ca = pki["other"] if trust == "other" else None
    with RelayClient(tls_server, ca=ca) as client:
        with pytest.raises(UntrustedServer) as refused:
            client.health()
        with pytest.raises(UntrustedServer):
            list(client.follow_events())  # the stream gives up at once: waiting will not help
    message = str(refused.value)
    assert tls_server in message and "--ca" in message and "RELAY_CA" in message
    assert "certificate verify failed" in message or "unable to get local issuer" in message, message

    args = ["--ca", str(ca)] if ca else []
    run = cli(*args, "ls", address=tls_server)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert tls_server in run.stderr and "RELAY_CA" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_an_agent_that_does_not_trust_the_ca_says_so_and_keeps_trying(tls_server, pki, relay_home):
    log_path = relay_home / "agent.log"
    env = {k: v for k, v in os.environ.items() if k != "RELAY_CA"}
    with open(log_path, "wb") as log:
        agent = subprocess.Popen([*CLI, "agent", "--address", tls_server, "--ca", str(pki["other"]), "--name", "doubter",
                                  "--work-dir", str(relay_home / "agent")], env={**env, "RELAY_HOME": str(relay_home)},
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while log_path.read_text(errors="replace").count("does not verify") < 2 and time.monotonic() < deadline:
            assert agent.poll() is None, log_path.read_text(errors="replace")
            time.sleep(0.1)
        text = log_path.read_text(errors="replace")
        assert f"the TLS certificate of the server at {tls_server} does not verify" in text, text
        assert f"trusting {pki['other']}" in text and "RELAY_CA=FILE" in text, text
        assert "Traceback" not in text, text
        with RelayClient(tls_server, ca=pki["ca"]) as client:
            assert client.nodes() == []  # it never got in
    finally:
        kill_group(agent.pid)
        agent.wait(timeout=10)
    assert group_members(agent.pid) == []


def test_plain_http_to_the_tls_port_is_refused_clearly(tls_server, pki):
    plain = tls_server.replace("https://", "http://")
    with RelayClient(plain) as client, pytest.raises(ServerUnavailable) as refused:
        client.health()
    assert f"its address is {tls_server}" in str(refused.value), refused.value
    run = cli("ls", address=plain)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "--tls-cert" in run.stderr, run.stderr


def test_https_to_a_plain_server_is_refused_clearly(server, pki):
    with RelayClient(server.replace("http://", "https://"), ca=pki["ca"]) as client:
        with pytest.raises(UntrustedServer) as refused:
            client.health()
    assert "no TLS handshake" in str(refused.value) and "http://" in str(refused.value), refused.value


def test_a_missing_ca_file_is_named(tls_server, tmp_path):
    missing = tmp_path / "nope.pem"
    with pytest.raises(InvalidSpec, match="nope.pem"):
        RelayClient(tls_server, ca=missing)
    run = cli("--ca", str(missing), "ls", address=tls_server)
    assert run.returncode == 1 and "nope.pem" in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("which", ["cert only", "key is the cert", "missing key"])
def test_the_server_refuses_tls_files_it_cannot_load(relay_home, pki, which):
    args = {"cert only": ["--tls-cert", str(pki["cert"])],
            "key is the cert": ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["cert"])],
            "missing key": ["--tls-cert", str(pki["cert"]), "--tls-key", str(relay_home / "no.key")]}[which]
    proc = subprocess.run([*CLI, "server", "--port", "0", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RELAY_HOME": str(relay_home)})
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "--tls-key" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
