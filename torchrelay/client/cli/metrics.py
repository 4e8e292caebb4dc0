"""`relay metrics JOB [-f]`: the metrics a job reported (per step, per rank), following with -f."""
from __future__ import annotations

from typing import Iterable

import typer
from rich.table import Table

from torchrelay.client.cli.common import OutputOpt, Output, client, console, dump, handle_errors, print_json
from torchrelay.wire import MetricPoint


@handle_errors
def metrics(job_id: str = typer.Argument(...), rank: int = typer.Option(0, help="rank to show (-1: all)"),
            last: int = typer.Option(20, "--last", "-n", help="rows to show (table only)"),
            follow: bool = typer.Option(False, "--follow", "-f", help="print points as they come until the job ends"),
            output: Output = OutputOpt) -> None:
    """Show reported metrics; -o json prints every point; -f follows the job (one line per point)."""
    with client() as c:
        if follow:
            return _follow(c.follow_metrics(job_id), rank, output)
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


def _follow(points: Iterable[MetricPoint], rank: int, output: Output) -> None:
    for p in points:
        if rank >= 0 and p.rank != rank:
            continue
        if output == Output.json:
            print_json(dump(p))
        else:
            values = "  ".join(f"{k} {v:.5g}" for k, v in sorted(p.values.items()))
            print(f"step {p.step}  rank {p.rank}  {values}", flush=True)
