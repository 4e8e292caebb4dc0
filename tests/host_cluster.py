"""A torchrelay cluster across test hosts: the server on one, an agent on each of the others.

Not a test module. ``HostCluster(hosts, root)`` (``hosts``: a ``tests.hosts.TestHosts``)
starts ``relay server --host <address of host 0>`` there, then ``relay agent --address
<server>`` on every other host with no ``--host`` (each finds the address on its route to
the server, as a user's would). Every process is started through ``hosts.popen``, so
``hosts.close()`` ends them whatever happens; each has its own ``RELAY_HOME`` under ``root``.

- ``address``: the server's URL (reachable from this machine through the bridge).
- ``kill_server()`` SIGKILLs the server; ``start_server()`` starts it again on the same
  host, port and state.
- ``agent_log(host)``: what that host's agent printed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.logins import login_as_admin as _login_as_admin
from tests.hosts import Host, TestHosts

CLI = [sys.executable, "-m", "torchrelay.client.cli.main"]


class HostCluster:
    __test__ = False

    def __init__(self, hosts: TestHosts, root: Path, *, heartbeat_timeout_s: float = 3.0,
                 agent_cpus: int = 2, server_args: tuple[str, ...] = ()) -> None:
        self.hosts, self.root = hosts, Path(root)
        self.server_host, *self.agent_hosts = hosts.hosts
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.server_args = server_args
        self.port = 0
        self.server: subprocess.Popen | None = None
        self.start_server()
        self.agents = {host.name: self._start_agent(host, agent_cpus) for host in self.agent_hosts}

    @property
    def address(self) -> str:
        return f"http://{self.server_host.address}:{self.port}"

    def home(self, host: Host) -> Path:
        path = self.root / host.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _popen(self, host: Host, argv: list[str], log_name: str) -> subprocess.Popen:
        home = self.home(host)
        env = {**os.environ, "RELAY_HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        env.pop("RELAY_ADDRESS", None)
        with open(home / log_name, "ab") as log:
            return self.hosts.popen(host, [*CLI, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

    def start_server(self, timeout_s: float = 60.0) -> None:
        """``relay server`` on host 0 (the port it had before, if any); returns once it listens."""
        host = self.server_host
        info_file = self.home(host) / "server.json"
        info_file.unlink(missing_ok=True)
        self.server = self._popen(host, ["server", "--host", host.address, "--port", str(self.port),
                                         "--heartbeat-timeout", str(self.heartbeat_timeout_s), *self.server_args],
                                  "server.log")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = json.loads(info_file.read_text())
                if info.get("pid"):
                    break
            except (OSError, ValueError):
                pass
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {(self.home(host) / 'server.log').read_text()[-3000:]}")
            time.sleep(0.05)
        self.port = int(info["address"].rsplit(":", 1)[1])
        _login_as_admin(self.home(host), self.address)  # as `relay login` would, for the tests and agents

    def kill_server(self) -> None:
        assert self.server is not None
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait(timeout=10)

    def _start_agent(self, host: Host, cpus: int) -> subprocess.Popen:
        return self._popen(host, ["agent", "--address", self.address, "--name", host.name, "--cpus", str(cpus),
                                  "--work-dir", str(self.home(host) / "agent")], "agent.log")

    def agent_log(self, host: Host) -> str:
        return (self.home(host) / "agent.log").read_text(errors="replace")
