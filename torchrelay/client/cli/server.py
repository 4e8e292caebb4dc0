"""`relay server`: run the server in the foreground."""
from __future__ import annotations

from pathlib import Path

import typer

from torchrelay.client.cli.common import handle_errors


@handle_errors
def server(host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0 for other hosts)"),
           port: int = typer.Option(8470, help="port; 0 lets the OS choose (see RELAY_HOME/server.json)"),
           db: str = typer.Option(None, "--db", envvar="RELAY_DB",
                                  help="state store, a SQLAlchemy URL, e.g. postgresql+psycopg://user:pw@host/relay "
                                       "(default: SQLite in RELAY_HOME); migrated at start"),
           store: str = typer.Option(None, "--store", envvar="RELAY_STORE", help="artifact store URL, e.g. s3://bucket/prefix "
                                     "(default: the config file's, else RELAY_HOME/store)"),
           config: Path = typer.Option(None, "--config", help="YAML server config: the store's URL and options "
                                       "(endpoint, region, credentials), see docs/storage.md"),
           heartbeat_timeout: float = typer.Option(10.0, help="seconds without heartbeat before a node is LOST"),
           quotas: Path = typer.Option(None, "--quotas", help="YAML file of per-user quotas: "
                                       "{USER | default: {cpus: N, gpus: N, jobs: N}}; a job over its user's "
                                       "quota waits (reason 'quota')"),
           slurm_partition: str = typer.Option(None, "--slurm-partition", help="also place jobs with "
                                               "`executor: slurm` on this Slurm partition (docs/slurm.md)"),
           slurm_dir: Path = typer.Option(None, "--slurm-dir", help="a folder every Slurm node sees at the same "
                                          "path: job folders (default: the store, when it is a local folder)"),
           slurm_python: str = typer.Option(None, "--slurm-python", help="the interpreter with torchrelay on the "
                                            "Slurm nodes (default: this server's)"),
           slurm_poll: float = typer.Option(10.0, "--slurm-poll", help="seconds between Slurm status calls "
                                            "(each poll is at most one squeue and one sacct)"),
           slurm_jobcomp: Path = typer.Option(None, "--slurm-jobcomp", help="Slurm's jobcomp/filetxt log, read "
                                              "for jobs squeue no longer lists when accounting is off"),
           slurm_accounting: bool = typer.Option(False, "--slurm-accounting", help="ask sacct (slurmdbd) for "
                                                 "jobs squeue no longer lists"),
           events: list[str] = typer.Option(None, "--events", help="send job events to a broker too: "
                                            "amqp://USER:PASS@HOST:PORT/VHOST?exchange=NAME or "
                                            "kafka://HOST:PORT/TOPIC; repeatable (docs/queues.md)"),
           advertise: str = typer.Option(None, envvar="RELAY_ADVERTISE", help="the URL other hosts reach this server at, which a "
                                         "follower names when another server leads (default: --host:--port)"),
           tls_cert: Path = typer.Option(None, "--tls-cert", envvar="RELAY_TLS_CERT",
                                         help="serve HTTPS with this PEM certificate (chain); needs --tls-key "
                                         "(docs/security.md, TLS)"),
           tls_key: Path = typer.Option(None, "--tls-key", envvar="RELAY_TLS_KEY",
                                        help="the PEM private key of --tls-cert"),
           log_level: str = typer.Option("warning")) -> None:
    """Run the torchrelay server until interrupted."""
    from torchrelay.server.main import serve, slurm_executor

    executors = []
    if slurm_partition:
        executors.append(slurm_executor(partition=slurm_partition, job_root=slurm_dir, store_url=store,
                                        python=slurm_python, poll_interval_s=slurm_poll, jobcomp=slurm_jobcomp,
                                        accounting=slurm_accounting))
    serve(host=host, port=port, db_url=db, store_url=store, heartbeat_timeout_s=heartbeat_timeout,
          log_level=log_level, quotas_file=quotas, executors=executors, config_file=config, events=events or (),
          advertise=advertise, tls_cert=tls_cert, tls_key=tls_key)
