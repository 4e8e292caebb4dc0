"""Scheduler benchmark: cycle time at scale, server throughput, and the policy next to FIFO.

(a) 1,000 simulated nodes (CPU, a100 and h100 nodes), 10,000 queued jobs of gangs of 1-16
    workers from 50 users at three priorities: the time of one ``schedule`` cycle. Reported:
    the cold cycle (empty cluster) and the median of steady cycles (full cluster; before each,
    1% of running jobs end, the queue is topped up to 10,000 and decisions are applied), wall and
    CPU time; also the last steady cycle without start estimates (what the server's tick needs)
    and the load average while it ran.
(b) with ``--server-part``: job submissions accepted per second over HTTP, and no-op jobs
    completed per second, on the real server (``torchrelay.server.app.create_app``); skipped
    when that module is not there. Also the server's CPU time per submission (what one core
    could accept whatever else runs), each no-op job's time queued / launching / running, and
    the CPU one no-op job costs (server, agents and their torchrun and workers). A baseline
    tree runs the same way: ``PYTHONPATH=OLD_TREE python OLD_TREE/bench/scheduler.py ...``.
(c) one simulated trace (``torchrelay.scheduler.simulate``): mean wait and utilisation of the
    policy next to plain FIFO (``fifo.schedule_fifo``), on the same cluster and trace.

Prints human-readable rows, then ``RESULT {json}``. Timings depend on the machine's load.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrelay.scheduler import Allocation, SchedulerInput, schedule  # noqa: E402
from torchrelay.scheduler.fifo import schedule_fifo  # noqa: E402
from torchrelay.scheduler.simulate import mixed_cluster, mixed_trace, random_job, simulate  # noqa: E402
from _env import SERVER_PACKAGES, header_line, package_versions, result_line  # noqa: E402


def _apply(decisions, running: dict, queue: dict, jobs: dict, now: float, rng: random.Random) -> None:
    """Carry out decisions as the server would: victims back to the queue, placements running."""
    for victim in decisions.preemptions:
        running.pop(victim)
        queue[victim] = jobs[victim]
    for placement in decisions.placements:
        job = queue.pop(placement.job_id)
        running[job.job_id] = Allocation(job.job_id, job.user, job.priority, placement.shape, placement.placement,
                                         preemptible=job.preemptible, started_at=now - rng.uniform(0, 3000),
                                         max_runtime_s=job.max_runtime_s)


def part_a(nodes_n: int, queued_n: int, steady_cycles: int, seed: int) -> dict:
    from dataclasses import replace

    rng = random.Random(seed)
    nodes = mixed_cluster(rng, nodes_n)
    seq = 0
    jobs: dict = {}

    def new_job():
        nonlocal seq
        seq += 1
        job = random_job(rng, seq, users=50, priorities=(0, 0, 0, 1, 5))
        jobs[job.job_id] = job
        return job

    queue = {j.job_id: j for j in (new_job() for _ in range(queued_n))}
    running: dict = {}
    now = 0.0
    load_before = os.getloadavg()[0]
    started, cpu_started = time.perf_counter(), time.process_time()
    decisions = schedule(SchedulerInput(nodes, (), tuple(queue.values()), now=now))
    cold_ms = (time.perf_counter() - started) * 1e3
    cold_cpu_ms = (time.process_time() - cpu_started) * 1e3
    print(f"(a) cold cycle: {nodes_n} empty nodes, {queued_n} queued: {cold_ms:8.1f} ms "
          f"(CPU {cold_cpu_ms:.1f} ms), {len(decisions.placements)} placed")
    _apply(decisions, running, queue, jobs, now, rng)
    times, cpu_times, placed, preempted = [], [], [], []
    for cycle in range(steady_cycles + 2):  # the first two settle preemptions started cold
        now += 60.0
        for job_id in sorted(running)[:: 100]:  # 1% of running jobs end
            del running[job_id]
        while len(queue) < queued_n:
            job = new_job()
            queue[job.job_id] = job
        inp = SchedulerInput(nodes, tuple(running.values()), tuple(queue.values()), now=now)
        started, cpu_started = time.perf_counter(), time.process_time()
        decisions = schedule(inp)
        elapsed = (time.perf_counter() - started) * 1e3
        if cycle >= 2:
            times.append(elapsed)
            cpu_times.append((time.process_time() - cpu_started) * 1e3)
            placed.append(len(decisions.placements))
            preempted.append(len(decisions.preemptions))
        _apply(decisions, running, queue, jobs, now, rng)
    median = statistics.median(times)
    fifo_times = []
    for _ in range(3):
        started = time.perf_counter()
        schedule_fifo(inp)
        fifo_times.append((time.perf_counter() - started) * 1e3)
    print(f"(a) steady cycle: {len(running)} running, {queued_n} queued: median {median:8.1f} ms "
          f"(min {min(times):.1f}, max {max(times):.1f}) over {len(times)} cycles; "
          f"placed/cycle {statistics.median(placed):g}, preempted/cycle {statistics.median(preempted):g}")
    print(f"(a) steady cycle, CPU time of this process: median {statistics.median(cpu_times):8.1f} ms "
          f"(wall above includes waiting for a core on a shared machine)")
    print(f"(a) plain FIFO on the last steady input:       median {statistics.median(fifo_times):8.1f} ms "
          f"(goal for the policy: <= 100 ms)")
    # what the server's scheduling tick needs: it shows no start estimates, only ``relay queue`` does
    no_estimates = []
    for _ in range(3):
        started = time.perf_counter()
        schedule(replace(inp, estimate_limit=0))
        no_estimates.append((time.perf_counter() - started) * 1e3)
    load = (load_before + os.getloadavg()[0]) / 2
    print(f"(a) the last steady input without start estimates (estimate_limit=0): median "
          f"{statistics.median(no_estimates):8.1f} ms")
    print(f"(a) load average (1 min) while part (a) ran: {load:.2f} on {os.cpu_count()} cores")
    return {"cycle_ms_median": round(median, 2), "cycle_cpu_ms_median": round(statistics.median(cpu_times), 2),
            "cold_cycle_ms": round(cold_ms, 1), "cold_cycle_cpu_ms": round(cold_cpu_ms, 1),
            "cycle_no_estimates_ms_median": round(statistics.median(no_estimates), 2),
            "fifo_cycle_ms_median": round(statistics.median(fifo_times), 2), "load_avg_part_a": round(load, 2)}


def part_c(nodes_n: int, jobs_n: int, gap_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    nodes = mixed_cluster(rng, nodes_n)
    trace = mixed_trace(rng, jobs_n, users=8, mean_gap_s=gap_s)
    rows = {}
    for name, policy in (("policy", schedule), ("fifo", schedule_fifo)):
        started = time.perf_counter()
        result = simulate(nodes, trace, policy)
        rows[name] = result
        print(f"(c) {name:6s}: mean wait {result.mean_wait:9.1f} s, p95 wait "
              f"{sorted(result.wait.values())[int(0.95 * len(result.wait))]:9.1f} s, utilisation "
              f"{result.utilisation:6.3f}, makespan {result.makespan:9.0f} s, preemptions {result.preemptions}, "
              f"{result.cycles} cycles in {time.perf_counter() - started:.1f} s")
    ours, fifo = rows["policy"], rows["fifo"]
    return {"utilisation_vs_fifo": round(ours.utilisation / fifo.utilisation, 3),
            "mean_wait_vs_fifo": round(ours.mean_wait / fifo.mean_wait, 3) if fifo.mean_wait else None,
            "utilisation": round(ours.utilisation, 3), "fifo_utilisation": round(fifo.utilisation, 3),
            "mean_wait_s": round(ours.mean_wait, 1), "fifo_mean_wait_s": round(fifo.mean_wait, 1)}


def part_b(submits: int, noop_jobs: int, threads: int = 32, timeout_s: float = 300.0) -> dict:
    """Submissions/s against a server with no agents (every job stays queued, so only acceptance
    is timed), then no-op jobs/s on an embedded cluster of 2 agents. Real processes, real HTTP.

    The submissions are timed with a lean client (one keep-alive ``http.client`` connection
    per thread, the request body serialised once): client and server share this machine's
    cores, and httpx costs about four times the server's CPU per request, so timing through
    the SDK measures the client. A shorter run through ``RelayClient.submit`` is shown too."""
    if importlib.util.find_spec("torchrelay.server.app") is None:
        print("(b) skipped: torchrelay.server.app is not there yet")
        return {}
    import tempfile

    from torchrelay.client.cluster import start_cluster
    from torchrelay.client.sdk import RelayClient
    from torchrelay.spec import JobSpec, JobState

    spec = {"name": "noop", "entrypoint": "python -c pass", "workers": 1, "resources": {"cpu": 0.5}}
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
        cluster = start_cluster(agents=0, home=Path(tmp) / "submit")
        try:
            body = json.dumps({"spec": JobSpec.parse(spec).to_public(), "bundle": None}).encode()
            lean = _timed_submits(cluster, lambda: _LeanSubmitter(cluster.address, body), submits, threads)
            with RelayClient(cluster.address, user="bench") as client:
                sdk_n = max(threads, submits // 4)
                via_sdk = _timed_submits(cluster, lambda: _SdkSubmitter(client, spec), sdk_n, 8)
            out["submits_per_s"] = round(lean["per_s"], 1)
            out["server_cpu_ms_per_submit"] = round(lean["server_ms"], 3)
            out["sdk_submits_per_s"] = round(via_sdk["per_s"], 1)
            load = os.getloadavg()[0]
            print(f"(b) submissions: {lean['done']} over HTTP from {threads} keep-alive connections in "
                  f"{lean['elapsed']:.2f} s: {out['submits_per_s']:.0f}/s (goal >= 1000/s); load average {load:.1f}")
            print(f"(b) CPU per submission: server {lean['server_ms']:.3f} ms (one core could accept "
                  f"{1e3 / lean['server_ms']:.0f}/s), client {lean['client_ms']:.3f} ms; both share this machine's cores")
            print(f"(b) through RelayClient.submit (httpx, 8 threads): {via_sdk['done']} in {via_sdk['elapsed']:.2f} s: "
                  f"{via_sdk['per_s']:.0f}/s; CPU per submission: server {via_sdk['server_ms']:.3f} ms, "
                  f"client {via_sdk['client_ms']:.3f} ms")
        finally:
            cluster.stop()
        cluster = start_cluster(agents=2, home=Path(tmp) / "noop")
        try:
            with RelayClient(cluster.address, user="bench") as client:
                cpu_before = sum(_cpu_seconds(p) for p in cluster.pids)
                server_before = _cpu_seconds(cluster.pids[0])
                started = time.perf_counter()
                ids = [client.submit(spec, upload=False).id for _ in range(noop_jobs)]
                wanted = set(ids)
                while True:  # only finished jobs are listed: the poll stays cheap for the server
                    done = client.jobs(state="SUCCEEDED,FAILED,CANCELLED", limit=10000, all_users=True)
                    finished = [j for j in done if j.id in wanted]  # the admin's token submitted for "bench"
                    if len(finished) == len(ids) or time.perf_counter() - started > timeout_s:
                        break
                    time.sleep(0.1)
                elapsed = time.perf_counter() - started
                load = os.getloadavg()[0]
                server_per_job = (_cpu_seconds(cluster.pids[0]) - server_before) / max(1, len(finished))
                time.sleep(1.0)  # let the agents reap their last launches so their CPU is counted
                cpu_per_job = (sum(_cpu_seconds(p) for p in cluster.pids) - cpu_before) / max(1, len(finished))
                failed = [f"{j.id}: {j.failure.reason if j.failure else j.state.value}"
                          for j in finished if j.state != JobState.SUCCEEDED]
                nodes = {n.name: n.state for n in client.nodes()}
                phases = _phases([client.job(i) for i in ids])
            out["noop_jobs_per_s"] = round(len(finished) / elapsed, 2)
            late = "" if len(finished) == len(ids) else f" (TIMED OUT after {timeout_s:g} s; nodes: {nodes})"
            print(f"(b) no-op jobs: {len(finished)} of {noop_jobs} finished on 2 agents in {elapsed:.2f} s: "
                  f"{out['noop_jobs_per_s']:.2f}/s (goal >= 50/s); not succeeded: {failed or 'none'}{late}")
            for name, values in phases.items():
                print(f"(b)   per job, {name:28s} median {statistics.median(values):6.2f} s "
                      f"(max {max(values):.2f})")
            print(f"(b)   CPU per no-op job (server + agents + their torchrun and workers): {cpu_per_job:.2f} s; "
                  f"at that cost this machine's {os.cpu_count()} cores finish at most "
                  f"{(os.cpu_count() or 1) / cpu_per_job:.2f} jobs/s; load average {load:.1f}")
            print(f"(b)   of which the server (submit, schedule, heartbeats, status, the bench's polls): "
                  f"{server_per_job * 1e3:.1f} ms, so one server core could finish {1 / server_per_job:.0f} jobs/s")
            out["noop_cpu_s_per_job"] = round(cpu_per_job, 3)
            out["noop_server_cpu_ms_per_job"] = round(server_per_job * 1e3, 2)
            out["noop_launch_s_median"] = round(statistics.median(phases["scheduled -> running (launch)"]), 2)
        finally:
            cluster.stop()
    return out


class _LeanSubmitter:
    """One keep-alive HTTP/1.1 connection that POSTs the same pre-serialised SubmitRequest."""

    def __init__(self, address: str, body: bytes):
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(address)
        self._conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        self._body = body
        from torchrelay.client.credentials import token_for

        self._headers = {"content-type": "application/json", "authorization": f"Bearer {token_for(address)}"}

    def __call__(self) -> str:
        self._conn.request("POST", "/api/v1/jobs", body=self._body, headers=self._headers)
        resp = self._conn.getresponse()
        data = resp.read()
        if resp.status != 201:
            raise RuntimeError(f"submit answered HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)["id"]

    def close(self) -> None:
        self._conn.close()


class _SdkSubmitter:
    """``RelayClient.submit`` as a submitter (the client is shared by the threads)."""

    def __init__(self, client, spec: dict):
        self._client, self._spec = client, spec

    def __call__(self) -> str:
        return self._client.submit(self._spec, upload=False).id

    def close(self) -> None:
        pass


def _timed_submits(cluster, make_submitter, count: int, threads: int) -> dict:
    """``count`` submissions from ``threads`` threads (one submitter each, made and warmed up
    before the clock starts): rate, and server / this process's CPU per submission."""
    import threading

    per_thread = max(1, count // threads)
    submitters = [make_submitter() for _ in range(threads)]
    for submit in submitters:
        submit()  # connect and warm up outside the timing
    ids: list[list[str]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(per_thread):
                ids[i].append(submitters[i]())
        except BaseException as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    server_cpu, client_cpu, started = _cpu_seconds(cluster.pids[0]), time.process_time(), time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - started
    server_s, client_s = _cpu_seconds(cluster.pids[0]) - server_cpu, time.process_time() - client_cpu
    for submit in submitters:
        submit.close()
    if errors:
        raise errors[0]
    done = sum(len(x) for x in ids)
    if len({i for x in ids for i in x}) != done:
        raise RuntimeError("the server handed out one job id twice")
    return {"done": done, "elapsed": elapsed, "per_s": done / elapsed, "server_ms": server_s / done * 1e3,
            "client_ms": client_s / done * 1e3}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its reaped children (from /proc)."""
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _phases(jobs) -> dict[str, list[float]]:
    """Seconds each job spent queued, launching (placed -> first rank running) and running."""
    from torchrelay.spec import JobState

    out: dict[str, list[float]] = {"queued -> scheduled": [], "scheduled -> running (launch)": [],
                                   "running -> finished": []}
    for job in jobs:
        times = {}
        for event in job.events:
            times.setdefault(event.state, event.time)
        if JobState.SCHEDULED in times and JobState.RUNNING in times and job.finished_at:
            out["queued -> scheduled"].append(times[JobState.SCHEDULED] - times[JobState.QUEUED])
            out["scheduled -> running (launch)"].append(times[JobState.RUNNING] - times[JobState.SCHEDULED])
            out["running -> finished"].append(job.finished_at - times[JobState.RUNNING])
    return {k: v for k, v in out.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--cycles", type=int, default=5, help="steady cycles to time in (a)")
    parser.add_argument("--trace-nodes", type=int, default=40)
    parser.add_argument("--trace-jobs", type=int, default=600)
    parser.add_argument("--trace-gap", type=float, default=4.0, help="mean seconds between arrivals in (c)")
    parser.add_argument("--server-part", action="store_true", help="also run (b) against the real server")
    parser.add_argument("--submits", type=int, default=1000, help="submissions timed in (b)")
    parser.add_argument("--noop-jobs", type=int, default=100,
                        help="no-op jobs timed in (b); fewer make the figure mostly start-up")
    parser.add_argument("--skip-a", action="store_true", help="skip part (a)")
    parser.add_argument("--skip-c", action="store_true", help="skip part (c)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    versions = package_versions(SERVER_PACKAGES)
    print(header_line(versions), flush=True)
    result = {"cycle_ms_median": None, "submits_per_s": None, "noop_jobs_per_s": None,
              "utilisation_vs_fifo": None, "mean_wait_vs_fifo": None}
    if not args.skip_a:
        result.update(part_a(args.nodes, args.queued, args.cycles, args.seed))
    if args.server_part:
        result.update(part_b(args.submits, args.noop_jobs))
    else:
        print("(b) not run: pass --server-part to measure the real server over HTTP")
    if not args.skip_c:
        result.update(part_c(args.trace_nodes, args.trace_jobs, args.trace_gap, args.seed))
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
