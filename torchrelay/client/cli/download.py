"""`relay download JOB [DEST]`: fetch a job's artifacts (models, results)."""
from __future__ import annotations

from pathlib import Path

import typer

from torchrelay.client.cli.common import OutputOpt, Output, client, console, handle_errors, print_json


@handle_errors
def download(job_id: str = typer.Argument(...), dest: Path = typer.Argument(None, help="folder (default ./JOB)"),
             output: Output = OutputOpt) -> None:
    """Download every artifact of the job into DEST."""
    with client() as c:
        info = c.job(job_id)
        paths = c.download(info.id, dest or Path(info.id))
    if output == Output.json:
        return print_json([str(p) for p in paths])
    if not paths:
        console.print(f"{info.id} has no artifacts")
    for p in paths:
        console.print(str(p), markup=False, highlight=False)
