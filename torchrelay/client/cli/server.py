"""`relay server`: run the server in the foreground."""
from __future__ import annotations

from pathlib import Path

import typer

from torchrelay.client.cli.common import handle_errors


@handle_errors
def server(host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0 for other hosts)"),
           port: int = typer.Option(8470, help="port; 0 lets the OS choose (see RELAY_HOME/server.json)"),
           db: str = typer.Option(None, "--db", help="SQLAlchemy URL (default: SQLite in RELAY_HOME)"),
           store: str = typer.Option(None, "--store", help="artifact store URL (default: RELAY_HOME/store)"),
           heartbeat_timeout: float = typer.Option(10.0, help="seconds without heartbeat before a node is LOST"),
           quotas: Path = typer.Option(None, "--quotas", help="YAML file of per-user quotas: "
                                       "{USER | default: {cpus: N, gpus: N, jobs: N}}; a job over its user's "
                                       "quota waits (reason 'quota')"),
           log_level: str = typer.Option("warning")) -> None:
    """Run the torchrelay server until interrupted."""
    from torchrelay.server.main import serve

    serve(host=host, port=port, db_url=db, store_url=store, heartbeat_timeout_s=heartbeat_timeout,
          log_level=log_level, quotas_file=quotas)
