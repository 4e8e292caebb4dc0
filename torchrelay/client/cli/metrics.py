"""`relay metrics JOB`: the metrics a job reported (per step, per rank)."""
from __future__ import annotations

import typer
from rich.table import Table

from torchrelay.client.cli.common import OutputOpt, Output, client, console, dump, handle_errors, print_json


@handle_errors
def metrics(job_id: str = typer.Argument(...), rank: int = typer.Option(0, help="rank to show (-1: all)"),
            last: int = typer.Option(20, "--last", "-n", help="rows to show (table only)"),
            output: Output = OutputOpt) -> None:
    """Show reported metrics; -o json prints every point."""
    with client() as c:
        points = list(c.iter_metrics(job_id))
    if rank >= 0:
        points = [p for p in points if p.rank == rank]
    if output == Output.json:
        return print_json(dump(points))
    keys = sorted({k for p in points for k in p.values})
    table = Table(box=None, header_style="bold")
    for col in ("STEP", "RANK", *keys):
        table.add_column(col, justify="right")
    for p in points[-last:]:
        table.add_row(str(p.step), str(p.rank), *(f"{p.values[k]:.5g}" if k in p.values else "" for k in keys))
    console.print(table)
