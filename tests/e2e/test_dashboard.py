"""The dashboard in a real browser (Debian's Chromium, driven by Playwright) against a real
server and agent running real training jobs. Screenshots of each page go to out/screenshots/.

The page is reached through a proxy whose connections the test cuts, so the browser's own
EventSource reconnects (with Last-Event-ID) while the job trains.
"""
import re
import time
from urllib.parse import urlparse

import httpx
import pytest

from conftest import SCREENSHOTS
from tcp_proxy import CuttableProxy
from torchrelay.client.cluster import AgentOptions, start_cluster, stop_cluster
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobSpec, JobState

pytestmark = pytest.mark.timeout(240)
JOBS = __import__("pathlib").Path(__file__).resolve().parents[1] / "jobs" / "dash"


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    """(client, dashboard base URL through the proxy, the proxy) for one cluster of one agent."""
    home = tmp_path_factory.mktemp("relay-dash")
    cluster = start_cluster(1, home=home, agent_options=[AgentOptions(cpus=4, labels={"zone": "test"})])
    try:
        with CuttableProxy(urlparse(cluster.address).port) as proxy, RelayClient(cluster.address) as c:
            yield c, f"http://127.0.0.1:{proxy.port}", proxy
    finally:
        stop_cluster(home)


def _submit(c, steps, pause, holds=None, **extra):
    args = f"{steps} {pause}" + (f" {holds}" if holds else "")
    spec = {"name": "dash", "entrypoint": f"python train.py {args}", "workers": 2, **extra}
    return c.submit(JobSpec.parse(spec), base_dir=JOBS).id


def _shot(page, name):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def _scrape(base, token):
    """/metrics parsed by prometheus_client's own parser: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=30, headers={"authorization": f"Bearer {token}"}).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _points(page, key="loss"):
    value = page.get_attribute(f'[data-key="{key}"]', "data-points")
    return int(value or 0)


def test_job_page_streams_curves_and_logs_through_dropped_connections(dash, browser_context, tmp_path):
    c, base, proxy = dash
    before = _scrape(base, c.token)
    holds = tmp_path / "holds"  # the job waits after steps 5 and 60 until hold-5 / hold-60 are there
    holds.mkdir()
    job_id = _submit(c, steps=80, pause=0.1, holds=holds)
    page = browser_context.new_page()
    try:
        page.goto(f"{base}/?token={c.token}#/jobs/{job_id}")  # signs in: a session cookie
        page.wait_for_selector('[data-key="loss"][data-points]:not([data-points="0"])', timeout=90_000)
        # the streams are cut while the job is held at step 5, and again while it trains on
        for hold in (5, 60):
            opens = int(page.get_attribute("#logs", "data-opens"))
            assert proxy.cut() > 0  # the page's streams were open
            page.wait_for_function(f'document.querySelector("#logs").dataset.opens > {opens}', timeout=60_000)
            seen = _points(page)
            (holds / f"hold-{hold}").touch()
            if hold == 5:  # the curve gains points while the job trains (the metrics stream reconnected)
                page.wait_for_function(f'document.querySelector(\'[data-key="loss"]\').dataset.points > {seen}',
                                       timeout=60_000)
                assert c.job(job_id).state == JobState.RUNNING
        final = c.wait(job_id, timeout=120)
        assert final.state == JobState.SUCCEEDED, final
        page.wait_for_selector('#logs[data-ended="1"]', timeout=30_000)
        page.wait_for_function('document.querySelector(\'[data-key="loss"]\').dataset.lastStep == "79"')
        # ranks trained on different data: one line per rank (uPlot's legend: step, rank 0, rank 1)
        assert page.locator('[data-key="loss"] .u-legend .u-series').count() == 3
        # every log line exactly once, in order, although the stream was cut mid-run
        shown = [int(x) for x in page.eval_on_selector_all("#logs .line", "els => els.map(e => e.dataset.seq)")]
        assert shown == [line.seq for line in c.iter_logs(job_id)]
        assert len(shown) >= 160
        _shot(page, "job")
        page.fill("#log-search", "step 42 ")
        found = page.eval_on_selector_all("#logs .line", "els => els.map(e => e.textContent)")
        assert sorted(found) == ["[0] rank 0 step 42 " + t.split("step 42 ")[1] for t in found if "[0]" in t] + \
            ["[1] rank 1 step 42 " + t.split("step 42 ")[1] for t in found if "[1]" in t] and len(found) == 2
        _shot(page, "job-log-search")
        page.fill("#log-search", "")
        page.select_option("#log-rank", "1")
        page.wait_for_function('document.querySelector("#logs").dataset.ended === "1" && '
                               'document.querySelectorAll("#logs .line").length >= 80')
        ranks = set(page.eval_on_selector_all("#logs .line", "els => els.map(e => e.dataset.rank)"))
        assert ranks == {"1"}
        links = page.eval_on_selector_all("#artifacts a", "els => els.map(e => e.getAttribute('href'))")
        assert f"/api/v1/jobs/{job_id}/artifacts/model.pt" in links
        assert page.locator("#checkpoints a").count() >= 1
        assert c.artifact_bytes(job_id, "model.pt")  # the link's target answers
        after = _scrape(base, c.token)
        moved = {name: after.get((name, labels), 0) - before.get((name, labels), 0) for name, labels in [
            ("torchrelay_submitted_jobs_total", ()), ("torchrelay_admitted_jobs_total", ()),
            ("torchrelay_admission_wait_time_seconds_count", ()),
            ("torchrelay_finished_jobs_total", (("state", "SUCCEEDED"),)),
            ("torchrelay_jobs", (("state", "SUCCEEDED"), ("user", c.user)))]}
        assert moved == dict.fromkeys(moved, 1), moved
        assert after[("torchrelay_node_heartbeat_age_seconds", (("node", "agent-0"),))] < 60
        assert after[("torchrelay_scheduling_cycle_seconds_count", ())] > before[("torchrelay_scheduling_cycle_seconds_count", ())]
        route = (("code", "200"), ("method", "GET"), ("route", "/api/v1/jobs/{job_id}/logs/stream"))
        assert after[("torchrelay_api_request_duration_seconds_count", route)] >= 3  # the page's stream, twice reopened
    finally:
        page.close()
    _cli_follows_the_streams(c, job_id)
    _tensorboard_files_read_back(c, job_id, tmp_path)


def _relay(c, *args):
    """The `relay` command in this process (typer's runner): what it prints; fails on exit != 0."""
    from typer.testing import CliRunner

    from torchrelay.client.cli.main import app

    result = CliRunner().invoke(app, list(args), env={"RELAY_ADDRESS": c.address})
    assert result.exit_code == 0, result.output
    return result.output


def _cli_follows_the_streams(c, job_id):
    """`relay logs -f` and `relay metrics -f` (the SSE streams) print every line and point once."""
    log_lines = _relay(c, "logs", job_id, "-f", "--rank", "1").splitlines()
    metric_lines = _relay(c, "metrics", job_id, "-f", "--rank", "-1").splitlines()
    assert [x.split(" loss")[0] for x in log_lines] == [f"[rank 1] rank 1 step {i}" for i in range(80)]
    assert sorted(x.split("  ")[0] + x.split("  ")[1] for x in metric_lines) == sorted(
        f"step {i}rank {r}" for i in range(80) for r in (0, 1))


def _tensorboard_files_read_back(c, job_id, tmp_path):
    """The server wrote the finished job's event files; `relay tensorboard --no-start` fetches
    them and TensorBoard's own reader finds every step of each rank (the ranks differ)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    deadline = time.monotonic() + 60
    while not any(a.path.startswith("tensorboard/") for a in c.artifacts(job_id)):
        assert time.monotonic() < deadline, "no TensorBoard files among the artifacts"
        time.sleep(0.2)
    _relay(c, "tensorboard", job_id, "--no-start", "--dest", str(tmp_path))
    for rank in (0, 1):
        acc = EventAccumulator(str(tmp_path / job_id / "tensorboard" / f"rank-{rank}"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("loss")] == list(range(80))
        assert {"loss", "samples_per_s"} <= set(acc.Tags()["scalars"])


def test_cluster_queue_and_jobs_pages_and_cancel_from_the_page(dash, browser_context):
    c, base, _ = dash
    running = _submit(c, steps=100_000, pause=0.05, resources={"cpu": 2})  # holds all 4 cpus
    waiting = _submit(c, steps=1, pause=0, resources={"cpu": 2})
    page = browser_context.new_page()
    try:
        page.goto(f"{base}/?token={c.token}#/cluster")
        page.wait_for_selector('[data-node="agent-0"]')
        row = page.inner_text('[data-node="agent-0"]')
        assert "READY" in row and "zone=test" in row
        page.wait_for_selector("#cluster-events li")
        _shot(page, "cluster")
        page.goto(f"{base}/#/queue")
        page.wait_for_selector(f'#queue [data-job="{waiting}"]', timeout=60_000)
        assert re.search(r"\S", page.inner_text(f'#queue [data-job="{waiting}"] td:nth-child(7)'))  # the reason
        _shot(page, "queue")
        page.goto(f"{base}/#/jobs?state=QUEUED")
        page.wait_for_selector(f'#jobs tr[data-job="{waiting}"]')
        states = page.eval_on_selector_all("#jobs tr[data-job] .state", "els => els.map(e => e.textContent)")
        assert set(states) == {"QUEUED"}
        page.goto(f"{base}/#/jobs")
        page.wait_for_selector(f'#jobs [data-job="{running}"]')
        page.fill("#filter-text", running)
        assert page.eval_on_selector_all("#jobs tr[data-job]", "els => els.map(e => e.dataset.job)") == [running]
        _shot(page, "jobs")
        # cancel from the job's page, once it trains
        page.goto(f"{base}/#/jobs/{running}")
        page.wait_for_selector('[data-key="loss"][data-points]:not([data-points="0"])', timeout=90_000)
        page.wait_for_function('document.querySelector(\'[data-key="loss"]\').dataset.points > 5')
        # /metrics while the job trains: its step rate and samples/s, and why the other waits
        labels = (("job", running), ("name", "dash"), ("user", c.user))
        scrape = _scrape(base, c.token)
        assert scrape[("torchrelay_job_step_rate", labels)] > 0
        assert scrape[("torchrelay_job_samples_per_second", labels)] > 0
        assert scrape[("torchrelay_pending_jobs", (("reason", "resources"),))] >= 1
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#cancel")
        assert c.wait(running, timeout=60).state == JobState.CANCELLED
        page.wait_for_selector("#job-head .s-cancelled", timeout=30_000)
        _shot(page, "job-cancelled")
    finally:
        page.close()
        c.cancel(running)
        c.cancel(waiting)


def test_balanced_shares_view_follows_the_ranks_reports(dash, browser_context):
    """A ``balance: throughput`` job's strategy view: each rank's share, speed and idle time, as
    the ranks report them, updated from the metrics stream while the page stays open."""
    c, base, _ = dash
    spec = {"name": "shares", "entrypoint": "python shares.py 400 0.05", "workers": 2,
            "strategy": {"kind": "ddp", "balance": "throughput"}}
    job_id = c.submit(JobSpec.parse(spec), base_dir=JOBS).id
    page = browser_context.new_page()
    try:
        page.goto(f"{base}/?token={c.token}#/jobs/{job_id}")
        page.wait_for_selector('#balanced-shares tr[data-rank="1"]', timeout=90_000)
        # the re-split (step 5) arrives through the stream: the page is not reloaded
        # (each rank's report may come in a different batch of the stream: wait for both)
        page.wait_for_function("['85', '43'].every((share, rank) => document.querySelector("
                               "`#balanced-shares tr[data-rank=\"${rank}\"] [data-share]`)?.dataset.share === share)",
                               timeout=60_000)
        row0 = page.inner_text('#balanced-shares tr[data-rank="0"]')
        row1 = page.inner_text('#balanced-shares tr[data-rank="1"]')
        assert "85" in row0 and "66.4%" in row0 and "4200" in row0 and "3%" in row0, row0
        assert "43" in row1 and "33.6%" in row1 and "2100" in row1 and "1%" in row1, row1
        _shot(page, "job-balanced-shares")
    finally:
        page.close()
        c.cancel(job_id)
