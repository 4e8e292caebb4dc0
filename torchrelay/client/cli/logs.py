"""`relay logs JOB [-f] [--rank R]`: print a job's log lines, following with -f."""
from __future__ import annotations

import typer

from torchrelay.client.cli.common import OutputOpt, Output, client, dump, handle_errors, print_json


@handle_errors
def logs(job_id: str = typer.Argument(...), follow: bool = typer.Option(False, "--follow", "-f"),
         rank: int = typer.Option(None, "--rank", help="only this global rank"),
         output: Output = OutputOpt) -> None:
    """Print the job's log lines, each prefixed with its rank."""
    with client() as c:
        if follow:
            lines = c.follow_logs(job_id, rank=rank)
        else:
            lines = c.iter_logs(job_id, rank=rank)
        for line in lines:
            if output == Output.json:
                print_json(dump(line))
            else:
                print(f"[rank {line.rank}] {line.text}", flush=True)

