"""An mpirun job across two test hosts (tests/hosts.py: network namespaces on a bridge, each with
its own address and loopback, no ssh anywhere): the server and agent 0 on host 0, agent 1 on
host 1. Open MPI's daemon on host 1 is handed over through the server and calls mpirun back
over the bridge; the ranks' MPI traffic crosses it too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.logins import login_as_admin as _login_as_admin
from tests.hosts import TestHosts

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(TestHosts.unavailable() is not None, reason=TestHosts.unavailable() or "")]
pytest.importorskip("mpi4py", reason="mpi4py is in the channels extra (make venv)")
JOBS = Path(__file__).resolve().parents[1] / "jobs" / "mpi"


@pytest.fixture(scope="module", autouse=True)
def open_mpi() -> None:
    """Open MPI here (installed when missing), or the test skips with the reason."""
    from tests.services.apt import open_mpi_unavailable

    reason = open_mpi_unavailable()
    if reason:
        pytest.skip(reason)

SUBMIT = r"""
import json, sys
from pathlib import Path
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobSpec
with RelayClient(sys.argv[1]) as c:
    c.wait_for_nodes(2, timeout=60)  # the server refuses a 2-node job while only one agent has registered
    spec = JobSpec.parse({"name": "mpi-hosts", "entrypoint": "python hello_mpi.py", "nodes": 2,
                          "workers_per_node": 1, "launcher": "mpirun"})
    info = c.submit(spec, base_dir=Path(sys.argv[2]))
    final = c.wait(info.id, timeout=150)
    lines = [[l.rank, l.text] for l in c.iter_logs(info.id)]
    print("RESULT", json.dumps({"state": final.state.value, "failure": final.failure and final.failure.model_dump(),
                                "nodes": sorted(p.node_name for p in final.placement), "lines": lines}), flush=True)
"""


def test_an_mpi_world_across_two_hosts_without_ssh(tmp_path):
    from torchrelay.home import read_json, server_file

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RELAY_AGENT_ZYGOTE": "0"}
    with TestHosts(2) as hosts:
        a, b = hosts.hosts
        home = tmp_path / "server"
        home.mkdir()
        hosts.popen(a, [sys.executable, "-m", "torchrelay.client.cli.main", "server", "--host", a.address,
                        "--port", "0"], env={**env, "RELAY_HOME": str(home)},
                    stdout=open(tmp_path / "server.log", "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (info := read_json(server_file(home))):
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        address = info["address"]
        _login_as_admin(home, address)  # as `relay login` would: the agents enrol with it, SUBMIT uses it
        for host in (a, b):
            hosts.popen(host, [sys.executable, "-m", "torchrelay.client.cli.main", "agent", "--address", address,
                               "--host", host.address, "--name", host.name, "--cpus", "2",
                               "--work-dir", str(tmp_path / host.name)],
                        env={**env, "RELAY_HOME": str(tmp_path / host.name)},
                        stdout=open(tmp_path / f"{host.name}.log", "wb"), stderr=subprocess.STDOUT)
        out = subprocess.run(["ip", "netns", "exec", a.name, sys.executable, "-c", SUBMIT, address, str(JOBS)],
                             env=env, capture_output=True, text=True, timeout=200)
        result = json.loads(out.stdout.split("RESULT", 1)[1]) if "RESULT" in out.stdout else {"out": out.stderr}
        logs = {p.name: p.read_text(errors="replace")[-2000:] for p in tmp_path.rglob("*.log")}
        assert result.get("state") == "SUCCEEDED", (result, logs)
        assert result["nodes"] == sorted([a.name, b.name])
        assert {(0, "mpi rank 0/2 sum=3"), (1, "mpi rank 1/2 sum=3")} <= {tuple(x) for x in result["lines"]}
        orted_log = next(tmp_path.glob("*/launches/*-n1/orted.log"))  # node rank 1: either host
        head = a if orted_log.relative_to(tmp_path).parts[0] == b.name else b
        assert f"tcp://{head.address}:" in orted_log.read_text()  # its daemon called mpirun back across the bridge
