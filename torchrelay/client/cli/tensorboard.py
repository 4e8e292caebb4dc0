"""`relay tensorboard JOB…`: download the jobs' TensorBoard event files and start TensorBoard on them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

from torchrelay.client.cli.common import client, console, handle_errors
from torchrelay.errors import InvalidSpec


@handle_errors
def tensorboard(job_ids: list[str] = typer.Argument(..., help="one or more jobs, compared side by side"),
                dest: Path = typer.Option(Path("relay-outputs/tensorboard"), help="where the event files go"),
                port: int = typer.Option(6006, help="TensorBoard's port"),
                start: bool = typer.Option(True, "--start/--no-start", help="start TensorBoard, or only download")
                ) -> None:
    """Fetch each job's event files (a run per job and rank: JOB/tensorboard/rank-R) and serve them with TensorBoard."""
    with client() as c:
        for job_id in job_ids:
            info = c.job(job_id)
            c.write_tensorboard(info.id)  # current for a running job too
            paths = c.download(info.id, dest / info.id, prefix="tensorboard/")
            console.print(f"{info.id}: {len(paths)} event file(s) in {dest / info.id / 'tensorboard'}", highlight=False)
    if not start:
        return
    try:
        import tensorboard as _tb  # noqa: F401
    except ImportError:
        raise InvalidSpec("TensorBoard is not installed here: pip install 'torchrelay[tensorboard]' "
                          f"(or run `tensorboard --logdir {dest}` where it is)") from None
    console.print(f"TensorBoard on http://127.0.0.1:{port}/ (Ctrl-C ends it)", highlight=False)
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(dest), "--host", "127.0.0.1",
                             "--port", str(port)])
    try:
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=10)
