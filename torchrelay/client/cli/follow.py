"""Follow a job: stream its logs and show live progress (step of total, loss, samples/s, ETA).

On a terminal the progress is a rich bar under the scrolling log; elsewhere (pipes, CI) it is
a plain line at most every ``plain_every_s`` seconds. Returns the job's final info; blocks
until the job is SUCCEEDED, FAILED or CANCELLED.
"""
from __future__ import annotations

import time
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn

from torchrelay.client.cli.common import console, duration
from torchrelay.wire import JobInfo


def _fmt_progress(values: dict[str, Any], rate: float | None) -> str:
    parts = []
    step, total = values.get("step"), values.get("total_steps")
    if step is not None:
        parts.append(f"step {int(step)}" + (f"/{int(total)}" if total else ""))
    if "loss" in values:
        parts.append(f"loss {values['loss']:.4f}")
    if "samples_per_s" in values:
        parts.append(f"{values['samples_per_s']:,.0f} samples/s")
    if rate and total and step is not None and total > step:
        parts.append(f"ETA {duration((total - step) / rate)}")
    return "  ".join(parts)


def follow(client, job_id: str, *, show_logs: bool = True, rank: int | None = None,  # noqa: ANN001
           plain_every_s: float = 2.0) -> JobInfo:
    log_after, metric_after = 0, 0
    latest: dict[str, Any] = {}
    first_seen: tuple[float, int] | None = None
    rate = None
    live = console.is_terminal
    # the step count and ETA are in `info` (total is unknown until the script reports it)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                        console=console, transient=False, disable=not live)
    task = progress.add_task(job_id, total=None, info="waiting for the first step…")
    last_plain = 0.0
    with progress:
        while True:
            page = client.logs(job_id, after=log_after, rank=rank, wait=0.5)
            log_after = page.next_after
            if show_logs:
                for line in page.lines:
                    progress.console.print(f"[rank {line.rank}] {line.text}", markup=False, highlight=False,
                                           soft_wrap=True)
            mpage = client.metrics(job_id, after=metric_after)
            metric_after = mpage.next_after
            points = [p for p in mpage.points if p.rank == 0] or mpage.points
            if points:
                point = max(points, key=lambda p: p.step)
                latest = {**latest, **point.values, "step": point.step}
                now = time.monotonic()
                if first_seen is None:
                    first_seen = (now, point.step)
                elif point.step > first_seen[1] and now > first_seen[0]:
                    rate = (point.step - first_seen[1]) / (now - first_seen[0])
                total = latest.get("total_steps")
                progress.update(task, completed=latest["step"], total=total or None,
                                info=_fmt_progress(latest, rate))
                if not live and now - last_plain >= plain_every_s:
                    last_plain = now
                    console.print(f"[{job_id}] {_fmt_progress(latest, rate)}", markup=False, highlight=False)
            if page.job_state.terminal and not page.lines:
                break
    info = client.job(job_id)
    if not live and latest:
        console.print(f"[{job_id}] {_fmt_progress(latest, None)}", markup=False, highlight=False)
    return info


def print_outcome(info: JobInfo) -> None:
    from torchrelay.client.cli.common import styled_state

    took = duration((info.finished_at or time.time()) - (info.started_at or info.submitted_at))
    console.print(f"job {info.id} {styled_state(info.state.value)} after {took}"
                  + (f" ({info.restarts} restart(s))" if info.restarts else "")
                  + (" on " + ", ".join(f"{p.node_name}×{p.workers}" for p in info.placement) if info.placement else ""),
                  soft_wrap=True)
    if info.failure:
        f = info.failure
        where = f" on node {f.node}" if f.node else ""
        console.print(f"[red]{f.reason}{where}[/]", highlight=False)
        for line in f.last_lines[-10:]:
            console.print(f"  | {line}", markup=False, highlight=False)
