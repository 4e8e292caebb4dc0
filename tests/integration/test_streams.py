"""Server-sent event streams and metric series of a real server process.

Rows are posted as an agent posts them; the streams are read through a proxy whose
connections the test cuts, so a reconnect really happens (the SDK's, with Last-Event-ID).
"""
import json
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from conftest import bearer

from tcp_proxy import CuttableProxy
from torchrelay.client.sdk import RelayClient
from torchrelay.errors import InvalidSpec, NotFound
from torchrelay.wire import LogBatch, LogRecord, MetricBatch, MetricRecord, NodeRegistration

pytestmark = pytest.mark.timeout(120)


def _job(c: RelayClient) -> str:
    """A job that stays QUEUED, so that a cancel ends it at once: a fresh node (the module's
    earlier ones go LOST, as nothing heartbeats) and a first job that holds its cpus."""
    c._request("POST", "/nodes/register", json=NodeRegistration(
        name=f"n{time.monotonic_ns()}", address="127.0.0.1", cpus=4, memory=2**30).model_dump())
    spec = {"entrypoint": "python x.py", "workers": 1, "resources": {"cpu": 4}}
    c.submit(spec, upload=False)
    return c.submit(spec, upload=False).id


def _post_logs(c: RelayClient, job_id: str, first: int, count: int, rank: int = 0) -> None:
    records = [LogRecord(rank=rank, seq=i, text=f"line {i}") for i in range(first, first + count)]
    c._request("POST", f"/jobs/{job_id}/logs", json=LogBatch(launch_id=f"L-{job_id}", records=records).model_dump())


def _post_metrics(c: RelayClient, job_id: str, steps: range, rank: int = 0, attempt: int = 0,
                  **values: float) -> None:
    records = [MetricRecord(rank=rank, seq=s, step=s, time=time.time(),
                            values={k: v * s for k, v in values.items()}) for s in steps]
    c._request("POST", f"/jobs/{job_id}/metrics", json=MetricBatch(launch_id=f"L-{job_id}-{attempt}", records=records).model_dump())


def test_log_stream_survives_cut_connections_without_miss_or_repeat(module_server):
    """A writer posts 300 lines in 30 batches; after every fifth batch has been received, the
    proxy cuts the stream (the SDK reconnects with Last-Event-ID) while more lines are posted."""
    with RelayClient(module_server) as c:
        job_id = _job(c)
        _post_logs(c, job_id, 0, 10)
        port = urlparse(module_server).port
        with CuttableProxy(port) as proxy, RelayClient(f"http://127.0.0.1:{proxy.port}", token=c.token) as via_proxy:
            got: list[str] = []
            cuts = []

            def writer() -> None:
                for batch in range(1, 30):
                    _post_logs(c, job_id, batch * 10, 10)
                    if batch % 5 == 0:
                        deadline = time.monotonic() + 60
                        while len(got) < (batch + 1) * 10 and time.monotonic() < deadline:
                            time.sleep(0.005)  # received: the stream is connected now
                        cuts.append(proxy.cut())  # the next batch is posted while the SDK reconnects
                c.cancel(job_id)  # the stream ends once the job has ended and every line was sent

            t = threading.Thread(target=writer)
            t.start()
            for line in via_proxy.follow_logs(job_id):
                got.append(line.text)
            t.join()
        assert cuts == [1] * 5  # each cut broke the one open stream (and the SDK reconnected)
        assert got == [f"line {i}" for i in range(300)]


def test_last_event_id_resumes_exactly_after_that_row(module_server):
    with RelayClient(module_server) as c:
        job_id = _job(c)
        _post_logs(c, job_id, 0, 5)
        seqs = [line.seq for line in c.iter_logs(job_id)]
        with httpx.stream("GET", f"{module_server}/api/v1/jobs/{job_id}/logs/stream",
                          headers={"last-event-id": str(seqs[2]), **bearer(module_server)}, params={"after": 0}, timeout=10) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            text = ""
            for chunk in resp.iter_text():
                text += chunk
                if "event: logs" in text and text.endswith("\n\n"):
                    break
        assert f"id: {seqs[4]}\n" in text and '"line 3"' in text and '"line 4"' in text
        assert '"line 2"' not in text  # the Last-Event-ID header wins over ?after=


def test_bad_last_event_id_and_unknown_job_are_clear_errors(module_server):
    with RelayClient(module_server) as c:
        job_id = _job(c)
        r = httpx.get(f"{module_server}/api/v1/jobs/{job_id}/logs/stream", headers={"last-event-id": "abc", **bearer(module_server)})
        assert r.status_code == 422 and "Last-Event-ID 'abc'" in r.json()["detail"]
        r = httpx.get(f"{module_server}/api/v1/jobs/job-999/metrics/stream", headers=bearer(module_server))
        assert r.status_code == 404 and "job-999" in r.json()["detail"]
        with pytest.raises(NotFound, match="job-999"):
            list(c.follow_logs("job-999"))
        with pytest.raises(InvalidSpec, match="points=3"):
            c.series(job_id, points=3)


def test_metric_and_event_streams_follow_until_the_job_ends(module_server):
    with RelayClient(module_server) as c:
        job_id = _job(c)
        _post_metrics(c, job_id, range(0, 50), loss=1.0)
        points, events = [], []

        def read_events() -> None:
            for ev in c.follow_events(job_id):
                events.append(ev)

        t = threading.Thread(target=read_events)
        t.start()
        stream = c.follow_metrics(job_id)
        for p in stream:
            points.append(p)
            if p.step == 49:
                break
        _post_metrics(c, job_id, range(50, 80), loss=1.0)
        c.cancel(job_id)
        points += list(c.follow_metrics(job_id, after=points[-1].seq))
        t.join(timeout=30)
        assert [p.step for p in points] == list(range(80))
        assert [e.state.value for e in events][-1] == "CANCELLED" and events[0].state.value == "QUEUED"
        assert all(e.job_id == job_id for e in events)
        # the cluster stream carries the same rows, and does not end: read what is there now
        cluster = []
        for ev in c.follow_events(None):
            if ev.job_id == job_id:
                cluster.append(ev)
            if ev.id == events[-1].id:
                break
        assert [e.id for e in cluster] == [e.id for e in events]


def test_series_are_downsampled_and_zoom_gives_full_resolution(module_server):
    with RelayClient(module_server) as c:
        job_id = _job(c)
        _post_metrics(c, job_id, range(0, 3_000), loss=1.0, lr=0.5)
        _post_metrics(c, job_id, range(0, 3_000), rank=1, loss=1.0, lr=0.5)
        page = c.series(job_id, points=500)
        # rank 1 reported the same values as rank 0: only rank 0 is drawn
        assert [(s.key, s.rank) for s in page.series] == [("loss", 0), ("lr", 0)] and page.ranks == [0, 1]
        loss = page.series[0]
        assert loss.total == 3_000 and len(loss.x) <= 500
        assert loss.x[0] == 0 and loss.x[-1] == 2_999 and loss.y[-1] == 2_999.0
        zoom = c.series(job_id, keys=["loss"], start=1000, end=1200, points=500)
        assert zoom.series[0].x == list(range(999, 1202))  # every point in range, one beyond each edge
        _post_metrics(c, job_id, range(3_000, 3_010), rank=1, loss=2.0)  # rank 1 now differs
        page2 = c.series(job_id, keys=["loss"], points=500)
        assert [s.rank for s in page2.series] == [0, 1] and page2.after > page.after
        # a resumed attempt restarting at step 2_990 replaces rank 0's tail from there
        _post_metrics(c, job_id, range(2_990, 2_995), attempt=1, loss=-1.0)
        tail = c.series(job_id, keys=["loss"], rank=0, start=2_980, end=3_000).series[0]
        assert tail.x[-1] == 2_994 and tail.y[-1] == -2_994.0 and tail.total == 2_995


@pytest.mark.parametrize("nan", [False, True], ids=["numbers", "with-a-nan"])
def test_first_keys_of_an_uncached_job_equal_the_cached_page(module_server, nan):
    """A few keys of a job the series cache has not read yet are extracted by the database
    alone (the dashboard's first chart); the page equals the one the full cache then gives:
    ranks that differ, a key some rows lack, a resumed attempt's tail. A NaN the database's
    JSON reader refuses makes the server read everything instead, with the same answer."""
    with RelayClient(module_server) as c:
        job_id = _job(c)
        _post_metrics(c, job_id, range(0, 2_000), loss=1.0, lr=0.5, acc=0.1)
        _post_metrics(c, job_id, range(0, 2_000), rank=1, loss=2.0, acc=0.1)  # no lr on rank 1
        _post_metrics(c, job_id, range(1_990, 2_100), attempt=1, loss=-1.0, lr=0.5)  # resumed at 1_990
        if nan:  # as Python's json writes it (httpx refuses to): a row SQLite's JSON reader cannot read
            body = MetricBatch(launch_id=f"L-{job_id}-1", records=[MetricRecord(
                rank=0, seq=2_100, step=2_100, time=time.time(), values={"loss": float("nan"), "lr": 0.5})])
            c._request("POST", f"/jobs/{job_id}/metrics", content=json.dumps(body.model_dump()),
                       headers={"content-type": "application/json"})
        first = c.series(job_id, keys=["loss"], points=300)
        whole = c.series(job_id, points=300)  # fills the cache
        cached = c.series(job_id, keys=["loss"], points=300)
        assert first.series == cached.series and [s.rank for s in first.series] == [0, 1]
        assert first.keys == whole.keys == ["acc", "loss", "lr"] and first.ranks == whole.ranks == [0, 1]
        assert first.after == whole.after
        loss0 = first.series[0]
        assert loss0.total == (2_101 if nan else 2_100) and loss0.x[-1] == (2_100 if nan else 2_099)
        assert (loss0.y[-1] is None) if nan else loss0.y[-1] == -2_099.0
        lr = c.series(job_id, keys=["lr", "acc"], rank=1, points=300)
        assert [(s.key, s.rank) for s in lr.series] == [("acc", 1)]
