"""The HTTP API of a real server process, through the SDK: errors, bundles, OpenAPI."""
import httpx
import pytest

from conftest import bearer

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
