"""What the trust boundary costs: submissions per second and heartbeat round trips per second,
side by side in one run: plain HTTP vs HTTPS (TLS), and requests without vs with a token.

Three real servers on 127.0.0.1 with no agents (every job stays queued and only acceptance is
timed), one per variant so that each holds as many queued jobs as the others: "open", the same
server with its guard taken out (``bench/_open_server.py``: torchrelay has no switch that turns
authentication off) and plain HTTP; "token", as shipped (the admin's token submits, the node's own
credential heartbeats) over plain HTTP; "token+tls", as shipped with a certificate from a CA made
here (trustme). The
variants are measured in turns, ``--rounds`` times after one round not counted (warm-up), and each figure is the median of its turns, so
load that comes and goes on a shared machine falls on every variant alike.

- submissions: ``--submits`` POSTs of one pre-serialised job from ``--threads`` keep-alive
  connections (``http.client``: the SDK's httpx would cost more CPU than the server and time the
  client; see bench/scheduler.py); also the server's CPU per submission.
- heartbeats: ``--heartbeats`` round trips (``wait_s`` 0, nothing to report) of one registered
  node over one keep-alive connection, one after the other: the latency an agent sees.

While one server is measured the others are paused (SIGSTOP), so their schedulers' cycles over
their queues do not take its cores. Connections are opened, and TLS handshakes made, before the clock starts: agents and clients keep
theirs open (a token is checked on every request; a check in the last 5 s is remembered).

Prints rows, then ``RESULT {"submit_auth_ratio", "heartbeat_auth_ratio", "submit_tls_ratio", ...}``
(auth: token / open; tls: token+tls / open, both checks on against both off; goals >= 0.9, 0.9, 0.8).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrelay.client.cluster import ServerTls, start_cluster  # noqa: E402
from torchrelay.home import admin_token_file, read_json, server_file  # noqa: E402
from torchrelay.spec import JobSpec  # noqa: E402
from _env import SERVER_PACKAGES, header_line, package_versions, result_line  # noqa: E402

SPEC = {"name": "noop", "entrypoint": "python -c pass", "workers": 1, "resources": {"cpu": 0.5}}
OPEN_SERVER = Path(__file__).resolve().parent / "_open_server.py"


@dataclass
class Target:
    """One server as the bench reaches it."""

    name: str
    address: str
    pid: int
    context: ssl.SSLContext | None  # None: plain HTTP

    def connect(self) -> http.client.HTTPConnection:
        url = urlsplit(self.address)
        if self.context is None:
            return http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        return http.client.HTTPSConnection(url.hostname, url.port, timeout=60, context=self.context)


def call(conn: http.client.HTTPConnection, method: str, path: str, body: bytes, headers: dict[str, str],
         expect: int) -> bytes:
    conn.request(method, "/api/v1" + path, body=body, headers=headers)
    reply = conn.getresponse()
    data = reply.read()
    if reply.status != expect:
        raise RuntimeError(f"{method} {path} answered HTTP {reply.status}: {data[:300]!r}")
    return data


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_submits(target: Target, headers: dict[str, str], count: int, threads: int) -> dict:
    """``count`` submissions from ``threads`` connections: per second, and server CPU ms per submission."""
    body = json.dumps({"spec": JobSpec.parse(SPEC).to_public(), "bundle": None}).encode()
    sent = {"content-type": "application/json", **headers}
    conns = [target.connect() for _ in range(threads)]
    for conn in conns:
        call(conn, "POST", "/jobs", body, sent, 201)  # connect (and handshake) outside the timing
    errors: list[BaseException] = []

    def run(conn: http.client.HTTPConnection) -> None:
        try:
            for _ in range(count // threads):
                call(conn, "POST", "/jobs", body, sent, 201)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(conn,)) for conn in conns]
    server_cpu, started = cpu_seconds(target.pid), time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed, server_s = time.perf_counter() - started, cpu_seconds(target.pid) - server_cpu
    for conn in conns:
        conn.close()
    if errors:
        raise errors[0]
    done = threads * (count // threads)
    return {"per_s": done / elapsed, "server_ms": server_s / done * 1e3}


def timed_heartbeats(target: Target, headers: dict[str, str], count: int, node_id: str) -> dict:
    """``count`` heartbeat round trips, one after the other on one connection."""
    body = json.dumps({"wait_s": 0}).encode()
    sent = {"content-type": "application/json", **headers}
    conn = target.connect()
    call(conn, "POST", f"/nodes/{node_id}/heartbeat", body, sent, 200)
    server_cpu, started = cpu_seconds(target.pid), time.perf_counter()
    for _ in range(count):
        call(conn, "POST", f"/nodes/{node_id}/heartbeat", body, sent, 200)
    elapsed, server_s = time.perf_counter() - started, cpu_seconds(target.pid) - server_cpu
    conn.close()
    return {"per_s": count / elapsed, "server_ms": server_s / count * 1e3, "rtt_ms": elapsed / count * 1e3}


def register(target: Target, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
    """A node that heartbeats (nothing will be placed on it: 0.001 cpus): its id, and the headers
    its heartbeats carry (its own credential, as an agent's do)."""
    conn = target.connect()
    body = json.dumps({"name": f"bench-{target.name}", "address": "127.0.0.1", "cpus": 0.001, "memory": 1 << 20})
    reply = json.loads(call(conn, "POST", "/nodes/register", body.encode(),
                            {"content-type": "application/json", **headers}, 200))
    conn.close()
    own = {"authorization": f"Bearer {reply['credential']}"} if headers and reply.get("credential") else {}
    return reply["node_id"], own


class OpenServer:
    """``relay server`` without its guard (``bench/_open_server.py``), in its own process group."""

    def __init__(self, home: Path):
        home.mkdir(parents=True)
        env = {**os.environ, "RELAY_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        env.pop("RELAY_ADDRESS", None)
        self.log = open(home / "server.log", "wb")
        self.proc = subprocess.Popen([sys.executable, str(OPEN_SERVER), "server", "--port", "0"], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not ((info := read_json(server_file(home))) and info.get("pid") == self.proc.pid):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"the open server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.address, self.pids = info["address"], [self.proc.pid]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


def make_pki(folder: Path) -> ServerTls:
    try:
        import trustme
    except ImportError:
        sys.exit("bench/auth.py needs trustme to make its CA (pip install -e '.[test]')")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    tls = ServerTls(cert=folder / "server.pem", key=folder / "server.key", ca=folder / "ca.pem")
    ca.cert_pem.write_to_path(str(tls.ca))
    leaf.private_key_pem.write_to_path(str(tls.key))
    for blob in leaf.cert_chain_pems:
        blob.write_to_path(str(tls.cert), append=True)
    return tls


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def measure(variants: dict[str, tuple[Target, dict[str, str]]], rounds: int,
            run: Callable[[Target, dict[str, str]], dict]) -> dict[str, list[dict]]:
    """Each variant once per round, in turns, after a round that warms every server and
    connection path up and is not counted; the rows of each. The servers not being measured are
    paused (SIGSTOP): each holds thousands of queued jobs, and its scheduler's cycles over them
    would otherwise take the measured server's cores at random."""
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    pids = {name: target.pid for name, (target, _) in variants.items()}
    try:
        for turn in range(rounds + 1):
            for name, (target, headers) in variants.items():
                for other, pid in pids.items():
                    os.kill(pid, signal.SIGCONT if other == name else signal.SIGSTOP)
                row = run(target, headers)
                if turn:
                    rows[name].append(row)
    finally:
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submits", type=int, default=800, help="submissions per variant and round")
    parser.add_argument("--threads", type=int, default=16, help="keep-alive connections submitting")
    parser.add_argument("--heartbeats", type=int, default=600, help="heartbeat round trips per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    versions = package_versions(SERVER_PACKAGES)
    print(header_line(versions))
    with tempfile.TemporaryDirectory(prefix="relay-bench-auth-") as tmp:
        tls = make_pki(Path(tmp))
        servers: list = []
        try:
            # one server per variant, so each holds as many queued jobs as the others at every turn
            variants = {}
            for name, server_tls in (("open", None), ("token", None), ("token+tls", tls)):
                home = Path(tmp) / name
                server = OpenServer(home) if name == "open" else start_cluster(agents=0, home=home, tls=server_tls)
                servers.append(server)
                headers = {} if name == "open" else {
                    "authorization": f"Bearer {admin_token_file(home).read_text().strip()}"}
                context = ssl.create_default_context(cafile=str(tls.ca)) if server_tls else None
                variants[name] = (Target(name, server.address, server.pids[0], context), headers)
            submits = measure(variants, args.rounds, lambda t, h: timed_submits(t, h, args.submits, args.threads))
            nodes = {target.name: register(target, headers) for target, headers in variants.values()}
            beat_variants = {name: (target, nodes[name][1]) for name, (target, _) in variants.items()}
            beats = measure(beat_variants, args.rounds,
                            lambda t, h: timed_heartbeats(t, h, args.heartbeats, nodes[t.name][0]))
        finally:
            for server in servers:
                server.stop()
    for name in variants:
        turns = " / ".join(", ".join(f"{row['per_s']:.0f}" for row in rows[name]) for rows in (submits, beats))
        print(f"{name:12s} submits {median_of(submits[name], 'per_s'):8.0f}/s (server CPU "
              f"{median_of(submits[name], 'server_ms'):.3f} ms each)   heartbeats {median_of(beats[name], 'per_s'):7.0f}/s "
              f"(round trip {median_of(beats[name], 'rtt_ms'):.2f} ms, server CPU "
              f"{median_of(beats[name], 'server_ms'):.3f} ms)   per round: {turns}")

    def ratio(rows: dict[str, list[dict]], over: str, under: str) -> float:
        return round(median_of(rows[over], "per_s") / median_of(rows[under], "per_s"), 3)

    result = {"submit_auth_ratio": ratio(submits, "token", "open"),
              "heartbeat_auth_ratio": ratio(beats, "token", "open"),
              "submit_tls_ratio": ratio(submits, "token+tls", "open"),
              "heartbeat_tls_ratio": ratio(beats, "token+tls", "open"),
              "submit_tls_only_ratio": ratio(submits, "token+tls", "token"),
              "submits_per_s": {name: round(median_of(rows, "per_s"), 1) for name, rows in submits.items()},
              "heartbeats_per_s": {name: round(median_of(rows, "per_s"), 1) for name, rows in beats.items()},
              "load_avg": round(os.getloadavg()[0], 2)}
    print(f"ratios: token/open: submit {result['submit_auth_ratio']} (goal >= 0.9), heartbeat "
          f"{result['heartbeat_auth_ratio']} (goal >= 0.9); token+tls/open: submit {result['submit_tls_ratio']} "
          f"(goal >= 0.8), heartbeat {result['heartbeat_tls_ratio']}; "
          f"load average {result['load_avg']} on {os.cpu_count()} cores")
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
