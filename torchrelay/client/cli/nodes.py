"""`relay nodes`: the cluster's nodes with free and used resources."""
from __future__ import annotations

from rich.table import Table

from torchrelay.client.cli.common import OutputOpt, Output, ago, client, console, dump, handle_errors, print_json
from torchrelay.spec import format_memory


@handle_errors
def nodes(output: Output = OutputOpt) -> None:
    """List nodes: state, cpus/gpus/memory used of total, launches; a node that gets no work
    although READY (its address is out of reach) says why below the table."""
    with client() as c:
        found = c.nodes()
    if output == Output.json:
        return print_json(dump(found))
    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "ADDRESS", "STATE", "CPUS", "GPUS", "MEMORY", "LAUNCHES", "SEEN"):
        table.add_column(col)
    for n in found:
        gpus = f"{n.used_gpus}/{n.gpus}" + (f" {n.gpu_type}" if n.gpu_type else "")
        state = f"{n.state} (unreachable)" if n.problem else n.state
        table.add_row(n.id, n.name, n.address, state, f"{n.used_cpus:g}/{n.cpus:g}", gpus,
                      f"{format_memory(n.used_memory)}/{format_memory(n.memory)}", str(len(n.launches)),
                      ago(n.last_seen))
    console.print(table)
    for n in found:  # what an executor said of its node (e.g. Slurm unreachable), below the table
        if n.note:
            console.print(f"{n.name}: {n.note}", markup=False, highlight=False)
        if n.problem:  # why a READY node gets no work (its address is out of the other hosts' reach)
            console.print(f"{n.name} ({n.id}) gets no work: {n.problem}", markup=False, highlight=False)
