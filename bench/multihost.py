"""Across hosts, each figure beside its baseline in one run (root: test hosts are network namespaces).

(a) ddp_2host_step_ratio: the median step of a 2-host DDP job (bench/multihost_ddp.py, one
    worker per host) run by the platform, over the same script under raw ``torchrun --nnodes 2``
    on the same two hosts (GLOO_SOCKET_IFNAME set by hand), rounds alternated.
(b) ps_veth_vs_tcp: parameter-server push+pull of 100 MB, the worker on this machine (on the
    bridge) and the shard on a test host, over raw TCP sendall/recv_into of the same bytes there
    and back over the same veth, rounds alternated (bench/ps.py's children, on the host).
(c) pg_submits_per_s: submits per second to a server on PostgreSQL (a private cluster, as the
    tests start it) and, beside it, on SQLite; 64 concurrent keep-alive clients with the admin's
    token (bench/scheduler.py's lean client), and the server's CPU per submit.
(d) failover_s, failover_steps_lost: two servers on one PostgreSQL and an agent running a job
    that reports a step every 50 ms; the leader killed (-9): seconds from the kill to the first
    heartbeat the new leader accepted (the node's last_seen), and steps missing or repeated in
    the job's metrics at its end (a restart would repeat them).

    sudo .venv/bin/python bench/multihost.py [--rounds 3] [--submits 2000]

Last line: ``RESULT {"ddp_2host_step_ratio", "ps_veth_vs_tcp", "pg_submits_per_s", "failover_s",
"failover_steps_lost", ...}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "integration"), str(REPO / "bench")]

from _env import SERVER_PACKAGES, header_line, package_versions, result_line  # noqa: E402

BENCH = REPO / "bench"


def ddp_ratio(rounds: int) -> dict:
    from tests.host_cluster import HostCluster
    from tests.hosts import TestHosts
    from torchrelay.client.sdk import RelayClient
    from torchrelay.spec import JobSpec

    ours, raw = [], []
    with tempfile.TemporaryDirectory() as root, TestHosts(3) as hosts:
        cluster = HostCluster(hosts, Path(root))
        h1, h2 = cluster.agent_hosts
        with RelayClient(cluster.address) as c:
            c.wait_for_nodes(2, timeout=120)
            for _ in range(rounds):
                job = c.submit(JobSpec.parse({"name": "ddp", "entrypoint": "python multihost_ddp.py", "nodes": 2,
                                              "workers_per_node": 1}), base_dir=BENCH)
                assert c.wait(job.id, timeout=300).state.value == "SUCCEEDED", c.job(job.id).failure
                text = "\n".join(line.text for line in c.iter_logs(job.id))
                ours.append(float(re.search(r"STEP_MEDIAN_S=([0-9.]+)", text).group(1)))
                raw.append(_raw_torchrun(hosts, h1, h2))
    return {"ours": ours, "raw": raw}


def _raw_torchrun(hosts, h1, h2) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": h1.ifname}
    outs = []
    procs = [hosts.popen(host, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                                "--nproc-per-node", "1", "--master-addr", h1.address, "--master-port", "29611",  # a fresh namespace: nothing else listens there
                                str(BENCH / "multihost_ddp.py")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
             for rank, host in enumerate((h1, h2))]
    for proc in procs:
        outs.append(proc.communicate(timeout=300)[0])
    return float(re.search(r"STEP_MEDIAN_S=([0-9.]+)", outs[0]).group(1))


def ps_over_veth(repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    import ps as ps_bench
    import torchrelay.train.ps as ps
    from tests.hosts import TestHosts
    from torchrelay.spec import ParameterServerStrategy

    strategy = ParameterServerStrategy(kind="parameter_server", servers=1, mode="sync",
                                       optimizer={"name": "sgd", "lr": 0.01})
    size = ps_bench.MB100
    with tempfile.TemporaryDirectory() as out, TestHosts(1) as hosts:
        os.chmod(out, 0o755)
        (host,) = hosts.hosts
        store = dist.TCPStore(hosts.bridge_address, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        hosts.popen(host, [sys.executable, str(BENCH / "ps.py"), "--child", "ps"], env={
            **env, "RANK": "1", "WORLD_SIZE": "2", "RELAY_PS_STORE": f"{hosts.bridge_address}:{store.port}",
            "RELAY_PS_HOST": host.address, "BENCH_CFG": json.dumps({"strategy": strategy.model_dump(), "out": out})})
        hosts.popen(host, [sys.executable, str(BENCH / "ps.py"), "--child", "tcp"],
                    env={**env, "BENCH_CFG": json.dumps({"repeats": repeats, "out": out, "host": host.address})})
        os.environ["RELAY_PS_SHM"] = "0"
        ctx = types.SimpleNamespace(rank=0, world_size=2, strategy=strategy, store=store)
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(size // 4 // ps_bench.N_TENSORS))
                                        for _ in range(ps_bench.N_TENSORS)])
        model, opt = ps.prepare(model, None, strategy, ctx)
        opt.zero_grad()
        for p in model.parameters():
            p.grad.fill_(1e-6)
        port_file = Path(out, "tcp_port")
        while not port_file.exists() or not port_file.read_text():
            time.sleep(0.05)
        import socket

        view = memoryview(bytearray(size))
        times: dict[str, list[float]] = {"raw": [], "ps": []}
        with socket.create_connection((host.address, int(port_file.read_text()))) as sock:
            for _ in range(repeats + 1):
                times["raw"].append(ps_bench.echo_round_trip(sock, view))
                t0 = time.perf_counter()
                opt.step()
                times["ps"].append(time.perf_counter() - t0)
        opt.close()
    return {k: v[1:] for k, v in times.items()}


def submits_per_s(pg, n: int) -> dict:
    """Submits/s to one server on PostgreSQL, then one on SQLite: 64 threads, each with a
    keep-alive connection and the admin's token, the request body serialised once (the lean
    client of bench/scheduler.py: an httpx client costs several times the server's CPU per
    request, and client and server share this machine's cores). Also the server's CPU per submit."""
    from scheduler import _LeanSubmitter, _timed_submits
    from test_store_durability import Server

    from torchrelay.spec import JobSpec

    body = json.dumps({"spec": JobSpec.parse({"name": "s", "entrypoint": "python -c pass"}).to_public(),
                       "bundle": None}).encode()
    out = {}
    for kind in ("postgresql", "sqlite"):
        with tempfile.TemporaryDirectory() as home:
            name = f"bench_{time.monotonic_ns()}"
            url = pg.url_of(name) if kind == "postgresql" else f"sqlite:///{home}/state.db"
            if kind == "postgresql":
                pg.create_database(name)
            server = Server(Path(home), url)
            try:
                address = server.start()
                timed = _timed_submits(types.SimpleNamespace(pids=[server.proc.pid]),
                                       lambda: _LeanSubmitter(address, body), n, 64)
                out[kind] = timed["per_s"]
                out[f"{kind}_server_ms"] = timed["server_ms"]
            finally:
                server.stop()
    return out


def failover(pg) -> dict:
    import httpx

    from test_store_durability import Server
    from torchrelay.client.sdk import RelayClient
    from torchrelay.spec import JobSpec

    steps = 300
    with tempfile.TemporaryDirectory() as root:
        root_path = Path(root)
        name = f"bench_fo_{time.monotonic_ns()}"
        pg.create_database(name)
        servers = []
        for label in ("a", "b"):
            (root_path / label).mkdir()
            servers.append(Server(root_path / label, pg.url_of(name), "--store", str(root_path / "store")))
        agent = None
        try:
            first = servers[0].start()
            while httpx.get(f"{first}/api/v1/health").headers.get("x-relay-role") != "leader":
                time.sleep(0.1)
            second = servers[1].start()
            token = (root_path / "a" / "admin.token").read_text().strip()  # the first start's admin
            agent = subprocess.Popen([sys.executable, "-m", "torchrelay.client.cli.main", "agent", "--address",
                                      f"{first},{second}", "--name", "a0", "--cpus", "1", "--work-dir",
                                      str(root_path / "a0")], env={**os.environ, "RELAY_HOME": root, "RELAY_ENROLL_TOKEN": token},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            with RelayClient(f"{first},{second}", token=token) as c:
                c.wait_for_nodes(1, timeout=60)
                job = c.submit(JobSpec.parse({"name": "fo", "entrypoint": f"python ticker.py {steps}"}),
                               base_dir=BENCH / "jobs")
                while len(list(c.iter_metrics(job.id))) < 20:
                    time.sleep(0.1)
                killed_at = time.time()
                servers[0].kill()
                while True:
                    try:
                        seen = [n.last_seen for n in RelayClient(second, token=token).nodes()]
                        if seen and seen[0] > killed_at:
                            break
                    except Exception:  # noqa: BLE001 - not leading yet
                        pass
                    time.sleep(0.05)
                failover_s = seen[0] - killed_at
                final = c.wait(job.id, timeout=300)
                got = [p.step for p in c.iter_metrics(job.id)]
                lost = (steps - len(set(got))) + (len(got) - len(set(got))) + final.restarts
        finally:
            if agent is not None:
                os.killpg(agent.pid, 15)
                agent.wait(timeout=30)
            for server in servers:
                server.stop()
            pg.drop_database(name)
    return {"failover_s": failover_s, "steps_lost": lost, "state": final.state.value}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--submits", type=int, default=2000)
    parser.add_argument("--ps-repeats", type=int, default=10)
    args = parser.parse_args()
    versions = package_versions((*SERVER_PACKAGES, "psycopg", "alembic"))
    print(header_line(versions), flush=True)
    from services.postgres import PostgresServer

    ddp = ddp_ratio(args.rounds)
    ddp_ratio_value = statistics.median(ddp["ours"]) / statistics.median(ddp["raw"])
    print(f"(a) 2-host DDP median step: torchrelay {statistics.median(ddp['ours']) * 1e3:.1f} ms, raw torchrun "
          f"{statistics.median(ddp['raw']) * 1e3:.1f} ms, ratio {ddp_ratio_value:.3f} (goal <= 1.03)", flush=True)
    psx = ps_over_veth(args.ps_repeats)
    ps_ratio = statistics.median(psx["raw"]) / statistics.median(psx["ps"])
    print(f"(b) 100 MB push+pull over veth: PS {statistics.median(psx['ps']) * 1e3:.1f} ms, raw TCP "
          f"{statistics.median(psx['raw']) * 1e3:.1f} ms, PS/TCP throughput {ps_ratio:.3f} (goal >= 0.9)", flush=True)
    reason = PostgresServer.unavailable()
    assert reason is None, reason
    pg = PostgresServer()
    try:
        subs = submits_per_s(pg, args.submits)
        print(f"(c) submits/s: PostgreSQL {subs['postgresql']:.0f}, SQLite {subs['sqlite']:.0f}, ratio "
              f"{subs['postgresql'] / subs['sqlite']:.2f} (goal: PostgreSQL >= 1000/s); server CPU per submit "
              f"{subs['postgresql_server_ms']:.3f} / {subs['sqlite_server_ms']:.3f} ms", flush=True)
        fo = failover(pg)
        print(f"(d) failover: leader killed -> first heartbeat at the new leader {fo['failover_s']:.2f} s (goal <= 10), "
              f"steps lost {fo['steps_lost']} (goal 0), job {fo['state']}", flush=True)
    finally:
        pg.stop()
    print(result_line({"ddp_2host_step_ratio": round(ddp_ratio_value, 4), "ps_veth_vs_tcp": round(ps_ratio, 4),
                       "pg_submits_per_s": round(subs["postgresql"]), "sqlite_submits_per_s": round(subs["sqlite"]),
                       "failover_s": round(fo["failover_s"], 2), "failover_steps_lost": fo["steps_lost"],
                       "ddp_step_ms": {"ours": [round(x * 1e3, 2) for x in ddp["ours"]],
                                       "raw": [round(x * 1e3, 2) for x in ddp["raw"]]}}, versions))


if __name__ == "__main__":
    main()
