"""The embedded cluster: a server and N agents as child processes on this machine.

Contract: ``start_cluster`` starts each part in its own process session (so the part and
everything it starts can be ended as one group), waits until the server answers and every
agent registered, and records pids in ``<RELAY_HOME>/cluster.json``. Its server listens where
the ``ListenPlan`` says (default: 127.0.0.1, a port the OS picks); an address given explicitly
is tried first, so one that is not this machine's or is in use is refused (``Conflict``,
naming who asked for it) before anything starts. ``stop_cluster`` ends them (SIGTERM to each
group, SIGKILL after a grace) and is idempotent. Nothing is left running; nothing outside
``RELAY_HOME`` is touched. Its server makes the first admin at its first start
(``<RELAY_HOME>/admin.token``), which the client then uses for this address by itself
(``credentials``), and so does a client of a cluster whose home is another folder: the token is
stored for its address as `relay login` would, until ``stop_cluster`` forgets it. The cluster
enrols its agents with an enrolment token it makes with it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from torchrelay import tls
from torchrelay.client.address import LOCAL_HOST, ListenPlan
from torchrelay.client.credentials import forget_token, store_token
from torchrelay.client.sdk import RelayClient
from torchrelay.errors import Conflict, ServerUnavailable
from torchrelay.home import admin_token_file, cluster_file, read_json, relay_home, server_file, write_json


@dataclass
class Cluster:
    home: Path
    address: str
    pids: list[int] = field(default_factory=list)

    def stop(self, grace_s: float = 10.0) -> None:
        stop_cluster(self.home, grace_s)


def _spawn(argv: list[str], home: Path, log_name: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RELAY_HOME": str(home), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env.pop("RELAY_ADDRESS", None)
    # 0600: the server's log holds the first admin's token, printed at its first start
    fd = os.open(logs / f"{log_name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=str(home))


@dataclass(frozen=True)
class AgentOptions:
    """What one agent of an embedded cluster offers (None: the agent's own default)."""

    cpus: float | None = None
    gpus: int | None = None
    gpu_type: str | None = None  # e.g. "h100"; needs gpus > 0
    memory: str | None = None  # e.g. "4GiB"
    labels: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        out: list[str] = []
        if self.cpus is not None:
            out += ["--cpus", str(self.cpus)]
        if self.gpus is not None:
            out += ["--gpus", str(self.gpus)]
        if self.gpu_type is not None:
            out += ["--gpu-type", self.gpu_type]
        if self.memory is not None:
            out += ["--memory", str(self.memory)]
        for key, value in sorted(self.labels.items()):
            out += ["--label", f"{key}={value}"]
        return out


@dataclass(frozen=True)
class ServerTls:
    """HTTPS for an embedded cluster's server: its PEM certificate and key, and the CA file its
    agents (and their workers) and this process's clients trust."""

    cert: Path
    key: Path
    ca: Path


def start_cluster(agents: int = 1, *, home: Path | None = None, agent_cpus: float | None = None,
                  heartbeat_timeout_s: float = 10.0, timeout_s: float = 60.0,
                  agent_options: list[AgentOptions] | None = None, quotas_file: Path | None = None,
                  listen: ListenPlan = ListenPlan(), server_args: Sequence[str] = (),
                  server_config: Path | None = None, server_env: dict[str, str] | None = None,
                  agent_env: dict[str, str] | None = None, tls: ServerTls | None = None) -> Cluster:
    """Start a server and ``agents`` agents; blocks until all are up. Raises ServerUnavailable,
    and ``Conflict`` when the server cannot listen where ``listen`` says.

    ``agent_options[i]`` (if given) sets what agent i offers; it overrides ``agent_cpus``.
    ``quotas_file`` is passed to the server as ``--quotas``, ``server_config`` as ``--config`` (the
    store's URL and options); ``server_args`` are more options of ``relay server`` (e.g.
    ``--slurm-partition``). ``server_env`` and ``agent_env`` are added to the environment of the
    server and of every agent (e.g. credentials only the agents' workers should hold). With ``tls``
    the server serves HTTPS and the agents trust ``tls.ca`` (``--ca``); plain HTTP otherwise."""
    if agent_options is not None and len(agent_options) != agents:
        raise ValueError(f"agent_options has {len(agent_options)} entries for {agents} agents; give one per agent")
    home = (home or relay_home()).resolve()
    home.mkdir(parents=True, exist_ok=True)
    existing = read_json(cluster_file(home))
    if existing and any(_alive(p) and _proc_start(p) in existing.get("starts", []) for p in existing.get("pids", [])):
        raise ServerUnavailable(f"an embedded cluster already runs from {home} (pids {existing['pids']}); "
                                "`relay down` stops it, or set RELAY_HOME to another folder")
    if listen.port or listen.host != LOCAL_HOST:
        check_listenable(listen)
    server_file(home).unlink(missing_ok=True)
    cli = [sys.executable, "-m", "torchrelay.client.cli.main"]
    server_argv = [*cli, "server", "--host", listen.host, "--port", str(listen.port),
                   "--heartbeat-timeout", str(heartbeat_timeout_s)]
    if quotas_file is not None:
        server_argv += ["--quotas", str(Path(quotas_file).resolve())]
    if server_config is not None:
        server_argv += ["--config", str(Path(server_config).resolve())]
    if tls is not None:
        server_argv += ["--tls-cert", str(Path(tls.cert).resolve()), "--tls-key", str(Path(tls.key).resolve())]
    ca = str(Path(tls.ca).resolve()) if tls is not None else None
    server = _spawn([*server_argv, *server_args], home, "server", server_env)
    pids = [server.pid]
    write_json(cluster_file(home), {"pids": pids, "starts": _starts(pids), "started_at": time.time()})
    try:
        address = _wait_for_server(home, server, timeout_s, ca)
        store_token(address, _admin_token(home, address))
        write_json(cluster_file(home), {"pids": pids, "starts": _starts(pids), "address": address,
                                        "started_at": time.time()})
        enrolment = {"RELAY_ENROLL_TOKEN": _enroll_token(home, address, ca)} if agents else {}
        for i in range(agents):
            argv = [*cli, "agent", "--address", address, "--name", f"agent-{i}",
                    "--work-dir", str(home / "agents" / f"agent-{i}")]
            if ca is not None:
                argv += ["--ca", ca]
            if agent_options is not None:
                argv += agent_options[i].argv()
            elif agent_cpus is not None:
                argv += ["--cpus", str(agent_cpus)]
            pids.append(_spawn(argv, home, f"agent-{i}", {**enrolment, **(agent_env or {})}).pid)
            write_json(cluster_file(home), {"pids": pids, "starts": _starts(pids), "address": address,
                                            "started_at": time.time()})
        with RelayClient(address, ca=ca, token=_admin_token(home, address)) as client:
            client.wait_for_nodes(agents, timeout=timeout_s)
    except BaseException:
        stop_cluster(home)
        raise
    return Cluster(home=home, address=address, pids=pids)


def _admin_token(home: Path, address: str) -> str:
    try:
        return admin_token_file(home).read_text().strip()
    except OSError as exc:
        raise ServerUnavailable(f"the server at {address} left no admin token at {admin_token_file(home)} "
                                f"({exc.strerror}); its state store was made elsewhere: start agents with "
                                "`relay agent --enroll-token`") from None


def _enroll_token(home: Path, address: str, ca: str | Path | None = None) -> str:
    """A node enrolment token made with the admin token the server wrote in ``home``."""
    with RelayClient(address, ca=ca, token=_admin_token(home, address)) as client:
        return client.admin.enroll_token(label="embedded cluster")["token"]


def check_listenable(listen: ListenPlan) -> None:
    """Raise ``Conflict`` (``ListenPlan.refusal``) unless a server could listen at ``listen``'s
    address now: bound the way ``relay server`` binds, then released."""
    family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server: TIME_WAIT is free
        try:
            sock.bind((listen.host, listen.port))
        except socket.gaierror as exc:
            raise Conflict(listen.refusal(None, str(exc))) from None
        except OSError as exc:
            raise Conflict(listen.refusal(exc.errno, exc.strerror or str(exc))) from None


def _wait_for_server(home: Path, proc: subprocess.Popen, timeout_s: float, ca: str | None = None) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = (home / "logs" / "server.log").read_text(errors="replace")[-2000:]
            raise ServerUnavailable(f"the server exited with code {proc.returncode} while starting:\n{log}")
        info = read_json(server_file(home))
        if info and info.get("pid") == proc.pid:
            try:
                httpx.get(info["address"] + "/api/v1/health", timeout=2,
                          verify=tls.verify_for(info["address"], ca)).raise_for_status()
                return info["address"]
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    raise ServerUnavailable(f"the server did not answer within {timeout_s:g} s; see {home / 'logs' / 'server.log'}")


def stop_cluster(home: Path | None = None, grace_s: float = 10.0) -> bool:
    """Stop the cluster recorded in ``home``; True if one was running. Agents go first so they
    can end their workers; then the server."""
    home = (home or relay_home()).resolve()
    info = read_json(cluster_file(home))
    if not info:
        return False
    # only processes this cluster started: a pid reused since then has another start time
    starts = info.get("starts", [])
    pids = [p for i, p in enumerate(info.get("pids", [])) if i < len(starts) and _proc_start(p) == starts[i]]
    ran = any(_alive(p) for p in pids)
    for group in (pids[1:], pids[:1]):
        for pid in group:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(_alive(p) for p in group) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in group:
            _signal_group(pid, signal.SIGKILL)
        for pid in group:
            _reap(pid)
    cluster_file(home).unlink(missing_ok=True)
    server_file(home).unlink(missing_ok=True)
    if info.get("address"):
        forget_token(info["address"])
    return ran


def _proc_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(") ", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _starts(pids: list[int]) -> list[int | None]:
    return [_proc_start(p) for p in pids]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # each part leads its own session, so its pid is its group id
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie not ours to reap still counts as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True
