"""`relay queue`: waiting jobs in the order the scheduler considers them, with reasons and
estimated starts (known where running jobs declared `max_runtime_s`)."""
from __future__ import annotations

import time

from rich.table import Table

from torchrelay.client.cli.common import OutputOpt, Output, ago, client, console, duration, handle_errors, print_json


@handle_errors
def queue(output: Output = OutputOpt) -> None:
    """Show the queue: position, job, priority, why it waits, estimated start."""
    with client() as c:
        rows = c.queue()
    if output == Output.json:
        return print_json(rows)
    if not rows:
        console.print("no job is waiting")
        return
    table = Table(box=None, header_style="bold")
    for col in ("#", "ID", "NAME", "USER", "PRIO", "WORKERS", "SUBMITTED", "EST. START", "WHY IT WAITS"):
        table.add_column(col)
    for r in rows:
        est = r.get("estimated_start")
        shown = "-" if est is None else ("now" if est <= time.time() else "in " + duration(est - time.time()))
        table.add_row(str(r["position"]), r["id"] or "(hidden)", r["name"] or "", r.get("user") or "", str(r["priority"]),
                      str(r["workers"]), ago(r["submitted_at"]), shown, r["reason"])
    console.print(table)
