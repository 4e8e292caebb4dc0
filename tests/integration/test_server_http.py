"""The HTTP API of a real server process, through the SDK: errors, bundles, OpenAPI."""
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import bearer, serving

from torchrelay.client.sdk import RelayClient
from torchrelay.errors import InvalidSpec, NotFound, ServerUnavailable, Unschedulable
from torchrelay.wire import NodeRegistration


def test_openapi_and_health(server):
    doc = httpx.get(f"{server}/api/v1/openapi.json", headers=bearer(server)).json()
    assert "/api/v1/jobs" in doc["paths"] and "/api/v1/nodes/{node_id}/heartbeat" in doc["paths"]
    with RelayClient(server) as c:
        assert c.health()["ok"] is True


def test_bad_specs_get_4xx_naming_field(server):
    with RelayClient(server) as c:
        with pytest.raises(InvalidSpec, match="unknown key 'bogus'"):
            c.submit({"entrypoint": "python x.py", "bogus": 1}, upload=False)
        r = httpx.post(f"{server}/api/v1/jobs", json={"spec": {"workers": 2}}, headers=bearer(server))
        assert r.status_code == 422 and "entrypoint" in r.json()["detail"]
        c._request("POST", "/nodes/register", json=NodeRegistration(
            name="n", address="127.0.0.1", cpus=2, memory=2**30).model_dump())
        with pytest.raises(Unschedulable, match="needs 64 workers"):
            c.submit({"entrypoint": "python x.py", "workers": 64}, upload=False)
        assert httpx.post(f"{server}/api/v1/jobs", json={"spec": {"entrypoint": "x", "workers": 64}},
                          headers=bearer(server)).status_code == 422


def test_unknown_job_is_404_naming_id(server):
    r = httpx.get(f"{server}/api/v1/jobs/job-4242", headers=bearer(server))
    assert r.status_code == 404 and "job-4242" in r.json()["detail"]
    with RelayClient(server) as c:
        with pytest.raises(NotFound, match="job-4242"):
            c.cancel("job-4242")


def test_bundle_upload_is_content_addressed(server, tmp_path):
    tmp_path = tmp_path / "work"
    tmp_path.mkdir()
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("x")
    with RelayClient(server) as c:
        d1 = c.upload_bundle(tmp_path)
        d2 = c.upload_bundle(tmp_path)
        assert d1 == d2
        blob = httpx.get(f"{server}/api/v1/bundles/{d1}", headers=bearer(server)).content
    import io
    import tarfile
    names = tarfile.open(fileobj=io.BytesIO(blob)).getnames()
    assert names == ["train.py"]


def test_no_server_is_a_clear_error(relay_home):
    with pytest.raises(ServerUnavailable, match="relay up"):
        RelayClient()
    with pytest.raises(ServerUnavailable, match="no torchrelay server answers"):
        RelayClient("http://127.0.0.1:9").health()


def test_a_long_poll_in_flight_is_answered_when_the_server_stops(relay_home):
    """On SIGTERM uvicorn lets the requests in flight finish: a follow waiting for news gets its
    (empty) page then, instead of holding the exit and being cut off at uvicorn's graceful timeout."""
    from torchrelay.home import read_json, server_file

    with serving(relay_home) as address:
        pid = read_json(server_file(relay_home))["pid"]
        with httpx.Client(base_url=f"{address}/api/v1", headers=bearer(address), timeout=120) as http:
            http.post("/nodes/register", json=NodeRegistration(name="n", address="127.0.0.1", cpus=2,
                                                               memory=2**30).model_dump()).raise_for_status()
            job = http.post("/jobs", json={"spec": {"entrypoint": "python x.py"}}).json()  # no agent runs it
            with ThreadPoolExecutor(1) as pool:
                follow = pool.submit(http.get, f"/jobs/{job['id']}/metrics", params={"after": 0, "wait": 60})
                time.sleep(1)  # the request is in the server's wait by then (a local request takes ms)
                assert not follow.done()
                os.kill(pid, signal.SIGTERM)
                reply = follow.result(timeout=60)
    assert reply.status_code == 200 and reply.json()["points"] == [], reply.text
