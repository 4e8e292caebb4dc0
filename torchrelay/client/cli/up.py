"""`relay up` / `relay down`: start and stop an embedded cluster (server + N agents) here."""
from __future__ import annotations

import signal
import threading
from pathlib import Path

import typer

from torchrelay.client.cli.common import console, handle_errors


@handle_errors
def up(agents: int = typer.Option(1, "--agents", "-n", min=1, help="agents (nodes) to start"),
       detach: bool = typer.Option(False, "--detach", "-d", help="return once up; `relay down` stops it"),
       cpus: float = typer.Option(None, "--cpus", help="cpus each agent offers (default: this machine's)"),
       heartbeat_timeout: float = typer.Option(10.0, help="seconds without heartbeat before a node is LOST"),
       quotas: Path = typer.Option(None, "--quotas", help="per-user quotas (YAML), see docs/scheduling.md")) -> None:
    """Start an embedded cluster on this machine (state in RELAY_HOME)."""
    from torchrelay.client.cluster import start_cluster, stop_cluster

    cluster = start_cluster(agents, agent_cpus=cpus, heartbeat_timeout_s=heartbeat_timeout, quotas_file=quotas)
    console.print(f"cluster up: server {cluster.address}, {agents} agent(s); home {cluster.home}")
    console.print(f"  export RELAY_ADDRESS={cluster.address}")
    if detach:
        return
    console.print("Ctrl-C stops it")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_cluster(cluster.home)
        console.print("cluster stopped")


@handle_errors
def down() -> None:
    """Stop the embedded cluster started by `relay up` (idempotent)."""
    from torchrelay.client.cluster import stop_cluster

    console.print("cluster stopped" if stop_cluster() else "no embedded cluster was running")
