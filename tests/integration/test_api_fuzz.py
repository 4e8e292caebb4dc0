"""The whole API, fuzzed from its own OpenAPI document (schemathesis over a live server on 127.0.0.1):
no request, well formed or not, gets a 5xx or a traceback in its reply, and the server logs none.

Every operation gets ``EXAMPLES`` generated requests, each sent twice: as generated (ids that are
mostly unknown: the 404 paths) and with its path's ids swapped for those of a job, node and bundle
the server really has (the paths behind the 404s). Long polls are capped at ``POLL_CAP_S`` and an
event stream is judged on its status line alone (it never ends), so the run stays short.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import bearer, serving
from torchrelay.client.sdk import RelayClient

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e .[test])")
requests = pytest.importorskip("requests")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

pytestmark = pytest.mark.timeout(300)
EXAMPLES = 20
POLL_CAP_S = 0.2
# what every fuzzed request carries: the one place a credential goes once the server asks for one
HEADERS: dict[str, str] = {}  # the admin's bearer token, set by the ``live`` fixture
TRACEBACK_MARKS = ("Traceback (most recent call last)", 'File "/', "site-packages/")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A server with one queued job (and its bundle and an artifact) and one registered node."""
    home = tmp_path_factory.mktemp("relay-home")
    work = tmp_path_factory.mktemp("job")
    (work / "train.py").write_text("print('hello')\n")
    with serving(home) as address:
        HEADERS.update(bearer(address))
        with RelayClient(address) as client:
            job = client.submit({"name": "fuzzed", "entrypoint": "python train.py", "workers": 1}, base_dir=work)
            client._request("PUT", f"/jobs/{job.id}/artifacts/model.pt", content=b"weights")
            node = client._request("POST", "/nodes/register", json={
                "name": "fuzz-node", "address": "127.0.0.1", "cpus": 1, "memory": 1 << 30,
            }).json()
        ids = {"job_id": job.id, "node_id": node["node_id"], "digest": job.bundle, "path": "model.pt"}
        yield address, ids, home / "server.log"


def _capped(case) -> None:
    """Long polls cut to POLL_CAP_S: the server's answer is what is fuzzed, not its patience."""
    if isinstance(case.query, dict) and isinstance(case.query.get("wait"), (int, float)):
        case.query["wait"] = min(case.query["wait"], POLL_CAP_S)
    if isinstance(case.body, dict) and isinstance(case.body.get("wait_s"), (int, float)):
        case.body["wait_s"] = min(case.body["wait_s"], POLL_CAP_S)


def _problem(case, address: str, session) -> str | None:
    """Send ``case``; a line describing what is wrong with the reply, or None."""
    kwargs = case.as_transport_kwargs(base_url=address, headers=HEADERS)
    where = f"{case.method} {case.formatted_path}"
    try:
        with session.request(**kwargs, stream=True, timeout=30) as reply:
            if reply.headers.get("content-type", "").startswith("text/event-stream"):
                body = ""  # an open stream: its status line is the answer
            else:
                body = reply.content[:100_000].decode("utf-8", "replace")
    except requests.RequestException as exc:
        return f"{where} -> no reply ({exc})\n  {case.as_curl_command()[:500]}"
    if reply.status_code >= 500:
        return f"{where} -> {reply.status_code} {body[:300]!r}\n  {case.as_curl_command()[:500]}"
    if any(mark in body for mark in TRACEBACK_MARKS):
        return f"{where} -> {reply.status_code} with a traceback: {body[:300]!r}\n  {case.as_curl_command()[:500]}"
    return None


def _fuzz(operation, address: str, ids: dict[str, str], session, found: list[str]) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        _capped(case)
        found.append(_problem(case, address, session))
        if case.path_parameters:
            real = {name: ids.get(name, value) for name, value in case.path_parameters.items()}
            if real != case.path_parameters:
                case.path_parameters = real
                found.append(_problem(case, address, session))

    run()


def test_no_request_gets_a_5xx_or_a_traceback(live):
    address, ids, server_log = live
    schema = schemathesis.openapi.from_url(f"{address}/api/v1/openapi.json", headers=HEADERS)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25, [f"{op.method} {op.path}" for op in operations]
    found: list[str | None] = []
    started = time.monotonic()
    with requests.Session() as session:
        for operation in operations:
            _fuzz(operation, address, ids, session, found)
    problems = sorted({p for p in found if p})
    assert len(found) >= EXAMPLES * len(operations) // 2, len(found)  # the requests were really sent
    assert problems == [], f"{len(problems)} bad replies of {len(found)} in {time.monotonic() - started:.0f} s:\n" + \
        "\n".join(problems[:40])
    # an error after a reply started (an event stream's) shows only in the server's log
    assert "Traceback" not in server_log.read_text(errors="replace"), server_log.read_text(errors="replace")[-3000:]
