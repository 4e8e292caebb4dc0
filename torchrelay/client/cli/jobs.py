"""`relay ls`, `relay status JOB`, `relay cancel JOB`: list, inspect and cancel jobs."""
from __future__ import annotations

import time

import typer
from rich.table import Table

from torchrelay.client.cli.common import (OutputOpt, Output, ago, client, console, dump, duration, handle_errors,
                                          print_json, styled_state)


@handle_errors
def ls(state: str = typer.Option(None, "--state", help="only jobs in these states, comma-separated, "
                                                         "e.g. QUEUED,RUNNING"),
       limit: int = typer.Option(50, "--limit", "-n", min=1, max=10000, help="at most this many jobs, the newest"),
       all_users: bool = typer.Option(False, "--all", help="every user's jobs (admins)"),
       output: Output = OutputOpt) -> None:
    """List your jobs, newest first (in the table and in -o json alike); waiting jobs say why they wait."""
    with client() as c:
        jobs = c.jobs(state, limit, all_users=all_users)
    if output == Output.json:
        return print_json(dump(jobs))
    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "USER", "STATE", "WORKERS", "SUBMITTED", "DURATION", "NOTE"):
        table.add_column(col)
    for j in jobs:
        took = None
        if j.started_at:
            took = (j.finished_at or time.time()) - j.started_at
        note = j.waiting_reason or (j.failure.reason if j.failure and j.state.value == "FAILED" else "")
        if j.restarts:
            note = f"{j.restarts} restart(s) {note}".strip()
        table.add_row(j.id, j.name, j.user or "", styled_state(j.state.value), str(j.spec.get("workers")),
                      ago(j.submitted_at), duration(took), note)
    console.print(table)


def rank_lines(ranks: dict) -> list[str]:
    """Each rank's share of the global batch, measured speed and idle time (pure)."""
    out = []
    for rank in sorted(ranks, key=int):
        figures = ranks[rank]
        parts = [f"rank {rank}:"]
        if "share" in figures:
            parts.append(f"share {figures['share']:.0f}")
        if "measured_samples_per_s" in figures:
            parts.append(f"{figures['measured_samples_per_s']:.0f} samples/s")
        if "idle_fraction" in figures:
            parts.append(f"idle {figures['idle_fraction']:.0%} of the step in the all-reduce")
        out.append("  ".join(parts))
    return out


@handle_errors
def status(job_id: str = typer.Argument(...), output: Output = OutputOpt) -> None:
    """Show a job: state, placement, restarts, failure (rank, exit code, last lines), metrics, events."""
    plan = layout = None
    with client() as c:
        j = c.job(job_id)
        strategy = j.spec.get("strategy", {})
        if strategy.get("kind") == "pipeline":
            plan = _artifact_json(c, j.id, "pipeline-plan.json")
        if strategy.get("kind") == "fsdp" or strategy.get("data_parallel") == "fsdp":
            layout = _artifact_json(c, j.id, "sharded-layout.json")
    if output == Output.json:
        return print_json({**dump(j), **({"pipeline_plan": plan} if plan else {}),
                           **({"sharded_layout": layout} if layout else {})})
    console.print(f"[bold]{j.id}[/] {j.name}  {styled_state(j.state.value)}  user={j.user}  "
                  f"attempt={j.attempt} restarts={j.restarts}")
    spec = j.spec
    console.print(f"  entrypoint: {spec['entrypoint']}", markup=False, highlight=False)
    console.print(f"  workers: {spec['workers']}  strategy: {spec['strategy']['kind']}  "
                  f"priority: {j.priority}  max_restarts: {spec.get('max_restarts', 0)}")
    if j.placement:
        console.print("  placement: " + ", ".join(f"{p.node_name} (node rank {p.node_rank}) × {p.workers}"
                                                  for p in j.placement))
    if j.waiting_reason:
        console.print(f"  waiting: {j.waiting_reason}")
    if j.last_metrics:
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in j.last_metrics.items() if k not in ("time", "ranks"))
        console.print(f"  last metrics: {shown}", highlight=False)
        for line in rank_lines(j.last_metrics.get("ranks") or {}):
            console.print(f"    {line}", highlight=False)
        failed_saves = j.last_metrics.get("checkpoint_failures")
        if failed_saves:  # reported by TrainState.save when the store failed a checkpoint
            console.print(f"  [yellow]checkpoints: {int(failed_saves)} save(s) failed, the last at step "
                          f"{int(j.last_metrics.get('checkpoint_failed_step', -1))}; training went on "
                          f"(the store's reason: relay logs {j.id})[/]", highlight=False)
    for i, r in enumerate(j.restart_reasons, 1):
        console.print(f"  restart {i}: {r.reason}" + (f" on {r.node}" if r.node else ""), highlight=False)
    if j.failure and j.state.value in ("FAILED", "RESTARTING"):
        f = j.failure
        console.print(f"  [red]failure: {f.reason}[/]" + (f" on node {f.node}" if f.node else "")
                      + (f" (exit code {f.exit_code})" if f.exit_code is not None else ""), highlight=False)
        for line in f.last_lines[-20:]:
            console.print(f"    | {line}", markup=False, highlight=False)
    for title, shown in (("pipeline plan", plan), ("sharded layout", layout)):
        if shown:
            console.print(f"  {title}:")
            for line in str(shown.get("text", "")).splitlines():
                console.print(f"    {line}", markup=False, highlight=False)
    if j.events:
        console.print("  events:")
        for e in j.events:
            console.print(f"    {time.strftime('%H:%M:%S', time.localtime(e.time))} {e.state.value:<10} {e.message}",
                          markup=False, highlight=False)


@handle_errors
def cancel(job_id: str = typer.Argument(...), wait: bool = typer.Option(True, help="wait until it has stopped"),
           checkpoint: bool = typer.Option(True, "--checkpoint/--no-checkpoint",
                                           help="give workers the job's stop_grace_s after SIGTERM to commit a "
                                                "checkpoint (default), or kill them at once"),
           output: Output = OutputOpt) -> None:
    """Cancel a job (idempotent): its workers are ended on every node."""
    with client() as c:
        info = c.cancel(job_id, checkpoint=checkpoint)
        if wait:
            info = c.wait(job_id, timeout=60)
    if output == Output.json:
        return print_json(dump(info))
    console.print(f"{info.id} {styled_state(info.state.value)}")


def _artifact_json(c, job_id: str, name: str) -> dict | None:  # noqa: ANN001
    """A JSON artifact the job's rank 0 saved (the pipeline plan, the sharded layout), if it did yet."""
    import json

    from torchrelay.errors import NotFound

    try:
        return json.loads(c.artifact_bytes(job_id, name))
    except (NotFound, ValueError):
        return None
