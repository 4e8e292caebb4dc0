"""What torchrelay costs over raw torchrun, on the digits job, side by side in one run.

For each repetition (alternating, so drift hits both alike):
- raw: ``torchrun --nproc-per-node 2 examples/digits/train.py`` started here;
- job: the same script submitted to a warm embedded cluster (1 agent, 2 workers).
Both write the same per-step metrics (``RELAY_METRICS_DIR`` is set for raw torchrun too).

Rows: median step time (``step_time_s`` reported by rank 0) and the time from launch (raw) or
submit (job, bundle upload included) to the first finished step. Ends with
``RESULT {"step_time_ratio": job/raw, "start_overhead_s": job - raw}``.

    .venv/bin/python bench/overhead.py [--reps 3] [--epochs 2]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
sys.path.insert(0, str(REPO))
from _env import SERVER_PACKAGES, header_line, package_versions, result_line  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_raw(args: argparse.Namespace, scratch: Path) -> tuple[float, list[float]]:
    metrics_dir = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "RELAY_METRICS_DIR": str(metrics_dir), "RELAY_OUTPUT_DIR": str(metrics_dir / "out"),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "train.py", "--epochs", str(args.epochs)]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=DIGITS, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"raw torchrun failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    points = [json.loads(x) for x in (metrics_dir / "rank-0.jsonl").read_text().splitlines() if x.strip()]
    steps = [p for p in points if "step_time_s" in p["values"]]
    return steps[0]["time"] - t0, [p["values"]["step_time_s"] for p in steps[1:]]


def run_job(client, args: argparse.Namespace) -> tuple[float, list[float]]:  # noqa: ANN001
    from torchrelay.spec import JobSpec

    spec = JobSpec.parse({"name": "digits-bench", "entrypoint": f"python train.py --epochs {args.epochs}",
                          "workers": 2})
    t0 = time.time()
    info = client.submit(spec, base_dir=DIGITS)
    final = client.wait(info.id, timeout=600)
    if final.state.value != "SUCCEEDED":
        raise SystemExit(f"job {info.id} ended {final.state.value}: {final.failure}")
    points = [p for p in client.iter_metrics(info.id) if p.rank == 0]
    steps = sorted((p for p in points if "step_time_s" in p.values), key=lambda p: p.step)
    return steps[0].time - t0, [p.values["step_time_s"] for p in steps[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    versions = package_versions(SERVER_PACKAGES)
    print(header_line(versions), flush=True)
    from torchrelay.client.cluster import start_cluster
    from torchrelay.client.sdk import RelayClient

    with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
        scratch = Path(tmp)
        os.environ["RELAY_HOME"] = str(scratch / "home")
        cluster = start_cluster(1)
        try:
            with RelayClient(cluster.address) as client:
                run_job(client, args)  # warm-up: bundle cached, page cache warm
                run_raw(args, scratch)
                raw_start, raw_steps, job_start, job_steps = [], [], [], []
                for rep in range(args.reps):
                    s, st = run_raw(args, scratch)
                    raw_start.append(s)
                    raw_steps += st
                    s, st = run_job(client, args)
                    job_start.append(s)
                    job_steps += st
                    print(f"rep {rep + 1}: first step raw {raw_start[-1]:.3f}s job {job_start[-1]:.3f}s",
                          flush=True)
        finally:
            cluster.stop()
    raw_med, job_med = statistics.median(raw_steps), statistics.median(job_steps)
    print(f"{'':24}{'raw torchrun':>14}{'torchrelay job':>16}{'ratio / diff':>14}")
    print(f"{'median step time (ms)':24}{raw_med * 1e3:14.3f}{job_med * 1e3:16.3f}{job_med / raw_med:14.3f}")
    rs, js = statistics.median(raw_start), statistics.median(job_start)
    print(f"{'to first step (s)':24}{rs:14.3f}{js:16.3f}{js - rs:+14.3f}")
    print(f"steps measured: raw {len(raw_steps)}, job {len(job_steps)}; reps {args.reps}")
    print(result_line({"step_time_ratio": round(job_med / raw_med, 4), "start_overhead_s": round(js - rs, 3)},
                      versions))


if __name__ == "__main__":
    main()
