"""A worker telling the server of a committed checkpoint (train/checkpoint_notice.py), against a
real HTTP server on 127.0.0.1 that answers with the statuses each case lists."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from torchrelay.train.checkpoint_notice import notify_commit


@pytest.fixture
def answering():
    """(start(statuses) -> address, requests): a server answering each POST with the next status."""
    requests: list[tuple[str, str, dict]] = []
    servers = []

    def start(statuses: list[int]) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                requests.append((self.path, self.headers["authorization"], body))
                self.send_response(statuses[min(len(requests), len(statuses)) - 1])
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"ok": true}')

            def log_message(self, *_args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start, requests
    for server in servers:
        server.shutdown()
        server.server_close()


def job_env(address: str) -> dict[str, str]:
    return {"RELAY_ADDRESS": address, "RELAY_TOKEN": "rlw_x", "RELAY_JOB_ID": "job-4"}


@pytest.mark.parametrize("statuses, took, posts", [
    ([200], True, 1),
    ([503, 200], True, 2),  # busy or not the leader: tried again
    ([401], False, 1),  # a stale attempt's token: trying again changes nothing
    ([503, 503, 503], False, 3),  # gives up after ATTEMPTS, never raises
])
def test_a_commit_is_posted_with_the_workers_token_and_retried_only_when_worth_it(answering, statuses, took, posts,
                                                                                  caplog):
    start, requests = answering
    assert notify_commit(8, "file:///c/step-0000000008", env=job_env(start(statuses))) is took
    assert len(requests) == posts
    assert requests[0] == ("/api/v1/jobs/job-4/checkpoints", "Bearer rlw_x",
                           {"step": 8, "url": "file:///c/step-0000000008"})
    assert ("did not record it" in caplog.text) is not took


def test_outside_a_job_or_with_a_bad_address_nothing_is_posted_and_nothing_raises(answering, caplog):
    start, requests = answering
    address = start([200])
    assert notify_commit(1, "file:///c", env={"RELAY_ADDRESS": address}) is False  # plain torchrun: no token
    assert notify_commit(1, "file:///c", env={**job_env(address), "RELAY_ADDRESS": "not a url"}) is False
    assert requests == [] and "'not a url'" in caplog.text
