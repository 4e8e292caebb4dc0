"""`relay up` / `relay down`: start and stop an embedded cluster (server + N agents) here.

The server listens where ``RELAY_ADDRESS`` says when it is set (so every later command reaches
it), else on 127.0.0.1 and ``--port`` (default: a port the OS picks); an address that is not this
machine's, or a port in use, is refused naming who asked for it, before anything starts.
"""
from __future__ import annotations

import os
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
       quotas: Path = typer.Option(None, "--quotas", help="per-user quotas (YAML), see docs/scheduling.md"),
       config: Path = typer.Option(None, "--config", help="the server's config file (YAML): the artifact store's "
                                   "URL and options, see docs/storage.md"),
       port: int = typer.Option(None, "--port", min=0, max=65535,
                                help="the server's port on 127.0.0.1 (default: RELAY_ADDRESS's when set, "
                                     "else one the OS picks)"),
       slurm_partition: str = typer.Option(None, "--slurm-partition", help="the server also places jobs with "
                                           "`executor: slurm` on this Slurm partition (docs/slurm.md)")) -> None:
    """Start an embedded cluster on this machine (state in RELAY_HOME). Its server listens where
    RELAY_ADDRESS says when set (refused when that is not this machine or the port is taken),
    else on 127.0.0.1 and --port."""
    from torchrelay.client.address import listen_plan
    from torchrelay.client.cluster import start_cluster, stop_cluster

    relay_address = os.environ.get("RELAY_ADDRESS")
    plan = listen_plan(relay_address, port)
    cluster = start_cluster(agents, agent_cpus=cpus, heartbeat_timeout_s=heartbeat_timeout, quotas_file=quotas,
                            listen=plan, server_args=["--slurm-partition", slurm_partition] if slurm_partition else [],
                            server_config=config)
    console.print(f"cluster up: server {cluster.address}, {agents} agent(s); home {cluster.home}")
    if relay_address:
        console.print(f"  RELAY_ADDRESS={relay_address} names it")
    else:
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
