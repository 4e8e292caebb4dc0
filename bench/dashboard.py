"""The dashboard's figures: report → point drawn, a big job's first chart, the cost of streaming clients.

Three measurements, each beside a baseline in the same run:

1. report → browser: a real job (server + agent + 2 workers) reports every 0.1 s; the job page
   in headless Chromium (Debian's, through Playwright) records when each point was drawn
   (``window.__relayTrace``). Latency = drawn − the worker's report time. Baselines: a Python
   client on the same SSE stream (received, not drawn), and one polling the metrics page every
   1 s (a page that "refreshes").
2. first chart: a job with 100 series × 100,000 points (one rank, 100 keys, written straight
   into the server's SQLite file, with the job row's last point as ingest leaves it) — the job
   page until its first chart, then every chart, is drawn, cold (the
   server's series cache empty) and warm; the bytes of the series response against the raw
   JSON of the same series.
3. CPU per streaming client: the server process's CPU (utime+stime from /proc) over a window
   while a writer posts a metric point every 0.1 s, with 0 and with 100 clients following the
   job; the same with 100 clients long-polling ``/metrics?after=&wait=`` as the baseline.

Usage: .venv/bin/python bench/dashboard.py [--quick]
Ends with RESULT {"report_to_browser_p95_s", "first_chart_s", "bytes_vs_raw", "cpu_per_100_clients", ...}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "tests"))
from _env import SERVER_PACKAGES, header_line, package_versions, result_line  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


# ---------------------------------------------------------------- 1. report -> browser

def _auth(address: str) -> dict[str, str]:
    """The header the relay client would send to ``address`` (every route but health needs a token)."""
    from torchrelay.client.credentials import token_for

    token = token_for(address)
    return {"authorization": f"Bearer {token}"} if token else {}


def sse_receiver(address: str, job_id: str, out: list[float], stop: threading.Event) -> None:
    from torchrelay.client.sdk import RelayClient
    with RelayClient(address) as c:
        for p in c.follow_metrics(job_id):
            out.append(time.time() - p.time)
            if stop.is_set():
                return


def polling_receiver(address: str, job_id: str, out: list[float], stop: threading.Event) -> None:
    after = 0
    with httpx.Client(base_url=address + "/api/v1", headers=_auth(address)) as http:
        while not stop.is_set():
            page = http.get(f"/jobs/{job_id}/metrics", params={"after": after}).json()
            now = time.time()
            out += [now - p["time"] for p in page["points"]]
            after = page["next_after"]
            if page["job_state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                return
            time.sleep(1.0)


def report_to_browser(context, steps: int) -> dict:
    from torchrelay.client.cluster import start_cluster, stop_cluster
    from torchrelay.client.sdk import RelayClient
    from torchrelay.spec import JobSpec

    home = Path(tempfile.mkdtemp(prefix="bench-dash-"))
    cluster = start_cluster(1, home=home)
    try:
        with RelayClient(cluster.address) as c:
            spec = JobSpec.parse({"name": "latency", "entrypoint": f"python train.py {steps} 0.1", "workers": 2})
            job_id = c.submit(spec, base_dir=REPO / "tests" / "jobs" / "dash").id
            page = context.new_page()
            page.add_init_script("window.__relayTrace = {pending: [], drawn: []};")
            page.goto(f"{cluster.address}/?token={_auth(cluster.address)['authorization'][7:]}#/jobs/{job_id}")
            stop = threading.Event()
            sse, polled = [], []
            threads = [threading.Thread(target=f, args=(cluster.address, job_id, out, stop), daemon=True)
                       for f, out in ((sse_receiver, sse), (polling_receiver, polled))]
            for t in threads:
                t.start()
            c.wait(job_id, timeout=600)
            stop.set()
            for t in threads:
                t.join(timeout=30)
            drawn = page.evaluate("window.__relayTrace.drawn")
            page.close()
        # a point is a (step, rank) report; keys of one point are drawn together
        browser = [d[3] - d[2] for d in drawn]
        return {"browser": browser, "sse": sse, "polling": polled}
    finally:
        stop_cluster(home)


# ---------------------------------------------------------------- 2. first chart of a big job

def big_job_db(home: Path, keys: int, steps: int) -> tuple[str, int]:
    """A state file with one finished job of ``keys`` metrics × ``steps`` steps; (db url, raw bytes)."""
    import numpy as np
    from sqlalchemy import insert, update

    from torchrelay.server.service import ClusterService
    from torchrelay.server.store import JobRow, MetricRow
    from torchrelay.wire import NodeRegistration

    url = f"sqlite:///{home / 'state.db'}"
    svc = ClusterService(url, str(home / "store"))
    svc.register(NodeRegistration(name="n", address="127.0.0.1", cpus=4, memory=2**30))
    info = svc.submit({"name": "big", "entrypoint": "python x.py", "workers": 1}, None, "bench")
    rng = np.random.default_rng(0)
    values = np.cumsum(rng.normal(0, 0.01, (steps, keys)), axis=0) + np.linspace(3, 0.5, steps)[:, None]
    names = [f"metric_{k:03d}" for k in range(keys)]
    seq = int(info.id.removeprefix("job-"))
    with svc.engine.begin() as conn:
        for first in range(0, steps, 5000):
            conn.execute(insert(MetricRow), [
                {"job_seq": seq, "launch_id": "L", "rank": 0, "agent_seq": s, "step": s, "time": 1e9 + s,
                 "values": dict(zip(names, values[s].tolist()))} for s in range(first, min(steps, first + 5000))])
        # what ingest leaves on the job row: its last point (the page picks its first chart's key from it)
        conn.execute(update(JobRow).where(JobRow.seq == seq).values(
            last_metrics={**dict(zip(names, values[-1].tolist())), "step": steps - 1, "time": 1e9 + steps - 1}))
    svc.stop()
    raw = sum(len(json.dumps({"key": n, "rank": 0, "x": list(range(steps)), "y": values[:, k].tolist()}))
              for k, n in enumerate(names))
    return url, raw


def first_chart(context, keys: int, steps: int) -> dict:
    from conftest import kill_group
    from torchrelay.home import read_json, server_file

    home = Path(tempfile.mkdtemp(prefix="bench-dash-big-"))
    url, raw = big_job_db(home, keys, steps)
    env = {**os.environ, "RELAY_HOME": str(home)}
    env.pop("RELAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "torchrelay.client.cli.main", "server", "--port", "0", "--db", url,
                             "--store", str(home / "store")], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (read_json(server_file(home)) or {}).get("pid") == proc.pid:
            time.sleep(0.05)
        address = read_json(server_file(home))["address"]
        token = (home / "admin.token").read_text().strip()
        times = []
        for _ in ("cold", "warm"):
            page = context.new_page()
            started = time.perf_counter()
            page.goto(f"{address}/?token={token}#/jobs/job-1")
            page.wait_for_function("document.querySelectorAll('.chart canvas').length >= 1", timeout=300_000)
            first = time.perf_counter() - started
            page.wait_for_function(f"document.querySelectorAll('.chart canvas').length >= {keys}", timeout=300_000)
            times.append((first, time.perf_counter() - started))
            page.close()
        sent = len(httpx.get(f"{address}/api/v1/jobs/job-1/series", params={"points": 1000}, timeout=300,
                             headers={"authorization": f"Bearer {token}"}).content)
        return {"cold_s": times[0][0], "cold_all_s": times[0][1], "warm_s": times[1][0], "warm_all_s": times[1][1],
                "bytes": sent, "raw_bytes": raw}
    finally:
        kill_group(proc.pid)
        proc.wait(timeout=10)


# ---------------------------------------------------------------- 3. CPU per streaming client

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def clients(address: str, job_id: str, count: int, mode: str, seconds: float) -> int:
    """``count`` clients following the job for ``seconds``; returns the points they received."""
    received = 0

    async def sse(http: httpx.AsyncClient) -> None:
        nonlocal received
        async with http.stream("GET", f"/jobs/{job_id}/metrics/stream", params={"after": 0}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ["):
                    received += line.count('"step"')

    async def longpoll(http: httpx.AsyncClient) -> None:
        nonlocal received
        after = 0
        while True:
            page = (await http.get(f"/jobs/{job_id}/metrics", params={"after": after, "wait": 30})).json()
            received += len(page["points"])
            after = page["next_after"]

    limits = httpx.Limits(max_connections=count + 10)
    async with httpx.AsyncClient(base_url=address + "/api/v1", timeout=60, limits=limits,
                                 headers=_auth(address)) as http:
        tasks = [asyncio.create_task((sse if mode == "sse" else longpoll)(http)) for _ in range(count)]
        await asyncio.sleep(seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return received


def streaming_cpu(window_s: float, count: int) -> dict:
    from conftest import serving
    from torchrelay.client.sdk import RelayClient
    from torchrelay.wire import MetricBatch, MetricRecord, NodeRegistration

    home = Path(tempfile.mkdtemp(prefix="bench-dash-cpu-"))
    out = {}
    with serving(home) as address, RelayClient(address) as c:
        pid = read_pid(home)
        c._request("POST", "/nodes/register", json=NodeRegistration(name="n", address="127.0.0.1", cpus=4,
                                                                    memory=2**30).model_dump())
        job_id = c.submit({"entrypoint": "python x.py", "workers": 1}, upload=False).id
        stop = threading.Event()

        def writer() -> None:
            seq = 0
            while not stop.is_set():
                record = MetricRecord(rank=0, seq=seq, step=seq, time=time.time(), values={"loss": 1.0 / (seq + 1)})
                c._request("POST", f"/jobs/{job_id}/metrics",
                           json=MetricBatch(launch_id="L", records=[record]).model_dump())
                seq += 1
                time.sleep(0.1)

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        for label, mode, n in (("idle", "sse", 0), ("sse", "sse", count), ("longpoll", "longpoll", count)):
            before = cpu_seconds(pid)
            got = asyncio.run(clients(address, job_id, n, mode, window_s))
            out[label] = {"cores": (cpu_seconds(pid) - before) / window_s, "points": got}
        stop.set()
        t.join(timeout=10)
    return out


def read_pid(home: Path) -> int:
    from torchrelay.home import read_json, server_file
    return int(read_json(server_file(home))["pid"])


# ---------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = parser.parse_args()
    versions = package_versions((*SERVER_PACKAGES, "playwright", "prometheus-client"))
    print(header_line(versions))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    steps, keys, points, window = (40, 10, 10_000, 5.0) if args.quick else (150, 100, 100_000, 20.0)

    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                        args=FLAGS, viewport={"width": 1400, "height": 1000})
        lat = report_to_browser(context, steps)
        print("\nreport → seen (s)            p50      p95   points")
        for label, key in (("browser, SSE, drawn", "browser"), ("python, SSE, received", "sse"),
                           ("python, 1 s polling", "polling")):
            vals = lat[key]
            print(f"  {label:26s} {pct(vals, .5):7.3f}  {pct(vals, .95):7.3f}  {len(vals):6d}")
        big = first_chart(context, keys, points)
        context.close()
    print(f"\nfirst chart, {keys} series × {points:,} points")
    print("                             first chart   all charts")
    print(f"  cold (server cache empty)  {big['cold_s']:9.2f} s  {big['cold_all_s']:9.2f} s")
    print(f"  warm                       {big['warm_s']:9.2f} s  {big['warm_all_s']:9.2f} s")
    print(f"  bytes sent {big['bytes']:,} vs raw JSON {big['raw_bytes']:,}: ratio {big['bytes'] / big['raw_bytes']:.4f}")
    cpu = streaming_cpu(window, 100)
    print("\nserver CPU, one job reporting at 10 Hz      cores   points received")
    for label in ("idle", "sse", "longpoll"):
        print(f"  {label:10s} ({0 if label == 'idle' else 100:3d} clients)              "
              f"{cpu[label]['cores']:6.3f}   {cpu[label]['points']:8d}")
    per_100_sse = cpu["sse"]["cores"] - cpu["idle"]["cores"]
    per_100_lp = cpu["longpoll"]["cores"] - cpu["idle"]["cores"]
    print(f"  100 SSE clients cost {per_100_sse:.3f} of a core; 100 long-polling clients {per_100_lp:.3f} "
          f"(ratio {per_100_sse / per_100_lp if per_100_lp > 0 else float('nan'):.2f})")
    print(result_line({
        "report_to_browser_p50_s": round(pct(lat["browser"], .5), 3),
        "report_to_browser_p95_s": round(pct(lat["browser"], .95), 3),
        "report_to_sse_client_p95_s": round(pct(lat["sse"], .95), 3),
        "report_to_polling_p95_s": round(pct(lat["polling"], .95), 3),
        "first_chart_s": round(big["cold_s"], 2), "first_chart_warm_s": round(big["warm_s"], 2),
        "all_charts_warm_s": round(big["warm_all_s"], 2),
        "bytes_vs_raw": round(big["bytes"] / big["raw_bytes"], 5),
        "cpu_per_100_clients": round(per_100_sse, 4), "cpu_per_100_longpoll_clients": round(per_100_lp, 4),
        "series": keys, "points_per_series": points, "load_avg": round(os.getloadavg()[0], 1),
    }, versions))


if __name__ == "__main__":
    main()
