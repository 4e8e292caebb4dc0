"""`relay run -- python train.py …`: submit the current folder and follow it.

Starts an embedded cluster (and stops it afterwards) when no server answers. Exits 0 only if
the job succeeded; Ctrl-C cancels the job.
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import typer

from torchrelay.client.cli.common import console, err_console, fail, handle_errors


@handle_errors
def run(ctx: typer.Context,
        workers: int = typer.Option(1, "--workers", "-w", min=1, help="worker processes"),
        strategy: str = typer.Option("ddp", "--strategy", help="ddp | local_sgd | diloco | final_average | "
                                                               "parameter_server | pipeline | fsdp"),
        name: str = typer.Option(None, help="job name (default: the folder's name)"),
        cpu: float = typer.Option(1.0, help="cpus per worker"),
        set_: list[str] = typer.Option([], "--set", help="override a spec field: key=value"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no log lines, only progress and outcome")) -> None:
    """Run a command as a job: `relay run --workers 2 -- python train.py --epochs 3`."""
    from torchrelay.client.cli.follow import follow, print_outcome
    from torchrelay.client.sdk import RelayClient
    from torchrelay.errors import ServerUnavailable
    from torchrelay.spec import JobSpec, apply_override

    cmd = list(ctx.args)
    if not cmd:
        fail("give the command to run after --, e.g. `relay run --workers 2 -- python train.py`")
    job_name = name or re.sub(r"[^A-Za-z0-9_.-]", "-", Path.cwd().name).strip("-.") or "job"
    data = {"name": job_name, "workdir": ".", "entrypoint": shlex.join(cmd), "workers": workers,
            "strategy": {"kind": strategy}, "resources": {"cpu": cpu}}
    for item in set_:
        data = apply_override(data, item)
    spec = JobSpec.parse(data)
    owned = None
    try:
        c = RelayClient()
        c.health()
    except ServerUnavailable:
        from torchrelay.client.cluster import start_cluster

        err_console.print("no server answers: starting an embedded cluster for this run")
        owned = start_cluster(1, agent_cpus=max(float(os.cpu_count() or 1), workers * cpu))
        c = RelayClient(owned.address)
    try:
        info = c.submit(spec)
        err_console.print(f"submitted {info.id}")
        try:
            final = follow(c, info.id, show_logs=not quiet)
        except KeyboardInterrupt:
            err_console.print(f"cancelling {info.id}…")
            c.cancel(info.id)
            final = c.wait(info.id, timeout=30)
        print_outcome(final)
        if final.state.value != "SUCCEEDED":
            raise typer.Exit(1)
    finally:
        c.close()
        if owned is not None:
            owned.stop()
