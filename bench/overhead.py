"""What torchrelay costs over raw torchrun, on the digits job, side by side in one run.

For each repetition (in the order raw, job, job, raw, ..., so drift hits both alike):
- raw: ``torchrun --nproc-per-node 2 examples/digits/train.py`` started here;
- job: the same script submitted to a warm embedded cluster (1 agent, 2 workers).
Both write the same per-step metrics (``RELAY_METRICS_DIR`` is set for raw torchrun too).

Like with like: before timing, a probe script runs once on each side, the way the digits
script runs (``rt.init()``, ``rt.prepare()``), and reports what decides a CPU step's speed:
torch's intra- and inter-op threads, CPU affinity, cgroup, niceness (its own and its
autogroup's), the garbage collector's state, whether glibc malloc was tuned
(``torchrelay/train/allocator.py``) and the environment variables that change threads or the
allocator. The bench prints both and names the settings the sides differ in
(``settings_differ`` in the RESULT), so a ratio that is not overhead alone says so. The agent runs
without cgroups (raw torchrun has none; a quota is the job's resources, not overhead); the
objects a warm zygote froze (``gc.freeze``) before forking a rank are shown, not compared.

Rows: per repetition and pooled, the median step time (``step_time_s`` reported by rank 0),
and the time from launch (raw) or submit (job, bundle upload included) to the first finished
step. Ends with ``RESULT {"step_time_ratio": job/raw, "start_overhead_s": job - raw,
"warm_start_vs_torchrun": job/raw of the time to the first step, ...}``: the job's ranks are
forked from the agent's warm zygote (the settings probe and the warm-up job warmed it), the
raw side is torchrun starting fresh interpreters.

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


INFORMATIONAL = {"gc_frozen_at_fork"}  # shown beside the settings, not one of them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What decides a CPU step's speed, as rank 0 of each side sees it after rt.prepare().
SETTINGS_PROBE = """
import gc, json, os, sys
import torch
import torchrelay.train as rt
from torchrelay.train import allocator
rt.init()
model = torch.nn.Linear(4, 4)
rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
def read(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None
if int(os.environ.get("RANK", "0")) == 0:
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND", "KMP_AFFINITY", "LD_PRELOAD",
             "PYTHONMALLOC", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
             "TORCHRELAY_MALLOC_TUNE", "RELAY_MALLOC_TUNE")
    print("SETTINGS " + json.dumps({
        "torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
        "affinity": sorted(os.sched_getaffinity(0)), "nice": os.nice(0), "cgroup": read("/proc/self/cgroup"),
        "autogroup_nice": read("/proc/self/autogroup").rpartition(" nice ")[2],  # the group's name differs
        "gc": [gc.isenabled(), list(gc.get_threshold())],
        # objects frozen by the warm zygote before it forked this rank: a property of warm launches
        # (the collector skips them), shown but not a setting the raw side could be given
        "gc_frozen_at_fork": gc.get_freeze_count(),
        "malloc_tuned": getattr(allocator, "_applied", "unknown"),  # None: nothing asked for it
        "python": sys.executable, **{name: os.environ.get(name) for name in names}}), flush=True)
rt.shutdown()
"""


def torchrun(script: str, args: list[str], cwd: Path, metrics_dir: Path) -> subprocess.CompletedProcess:
    """``script`` under raw torchrun on 2 processes, as a user starts it (stdout captured)."""
    env = {**os.environ, "RELAY_METRICS_DIR": str(metrics_dir), "RELAY_OUTPUT_DIR": str(metrics_dir / "out"),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"raw torchrun failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return proc


def settings_line(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("SETTINGS ")]
    if not lines:
        raise SystemExit(f"the settings probe printed no SETTINGS line:\n{text[-2000:]}")
    return json.loads(lines[-1].removeprefix("SETTINGS "))


def probe_settings(client, scratch: Path) -> tuple[dict, dict]:  # noqa: ANN001
    """(raw, job): what rank 0 of each side runs with."""
    from torchrelay.spec import JobSpec

    probe_dir = scratch / "probe"
    probe_dir.mkdir()
    (probe_dir / "probe.py").write_text(SETTINGS_PROBE)
    raw = settings_line(torchrun("probe.py", [], probe_dir, scratch / "probe-metrics").stdout.decode())
    info = client.submit(JobSpec.parse({"name": "settings-probe", "entrypoint": "python probe.py", "workers": 2}),
                         base_dir=probe_dir)
    final = client.wait(info.id, timeout=300)
    logs = "\n".join(line.text for line in client.iter_logs(info.id) if line.rank == 0)
    if final.state.value != "SUCCEEDED":
        raise SystemExit(f"the settings probe job ended {final.state.value}: {final.failure}\n{logs[-2000:]}")
    return raw, settings_line(logs)


def run_raw(args: argparse.Namespace, scratch: Path) -> tuple[float, list[float]]:
    metrics_dir = Path(tempfile.mkdtemp(dir=scratch))
    t0 = time.time()
    torchrun("train.py", ["--epochs", str(args.epochs)], DIGITS, metrics_dir)
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

    sides = {"raw": ([], []), "job": ([], [])}  # side -> (time to first step per rep, step medians per rep)
    steps: dict[str, list[float]] = {"raw": [], "job": []}
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
        scratch = Path(tmp)
        os.environ["RELAY_HOME"] = str(scratch / "home")
        # the agent's cgroups off: raw torchrun runs in no job cgroup either, and a CPU quota is
        # the job's resources enforced (docs/heterogeneous.md), not the platform's overhead
        cluster = start_cluster(1, agent_env={"RELAY_AGENT_CGROUPS": "off"})
        try:
            with RelayClient(cluster.address) as client:
                raw_settings, job_settings = probe_settings(client, scratch)
                differ = sorted(k for k in raw_settings.keys() | job_settings.keys()
                                if raw_settings.get(k) != job_settings.get(k) and k not in INFORMATIONAL)
                print(f"settings, raw torchrun: {json.dumps(raw_settings)}")
                print(f"settings, job:          {json.dumps(job_settings)}")
                print("settings: the same on both sides" if not differ else
                      f"settings DIFFER in {', '.join(differ)}: the ratio is not overhead alone", flush=True)
                run_job(client, args)  # warm-up: bundle cached, page cache warm
                run_raw(args, scratch)
                runners = {"raw": lambda: run_raw(args, scratch), "job": lambda: run_job(client, args)}
                for rep in range(args.reps):
                    for side in ("raw", "job") if rep % 2 == 0 else ("job", "raw"):
                        first, st = runners[side]()
                        sides[side][0].append(first)
                        sides[side][1].append(statistics.median(st))
                        steps[side] += st
                    (rf, rm), (jf, jm) = ((sides[x][0][-1], sides[x][1][-1]) for x in ("raw", "job"))
                    print(f"rep {rep + 1}: median step raw {rm * 1e3:.3f} ms job {jm * 1e3:.3f} ms "
                          f"(ratio {jm / rm:.3f}); first step raw {rf:.3f} s job {jf:.3f} s", flush=True)
        finally:
            cluster.stop()
    raw_med, job_med = statistics.median(steps["raw"]), statistics.median(steps["job"])
    print(f"{'':24}{'raw torchrun':>14}{'torchrelay job':>16}{'ratio / diff':>14}")
    print(f"{'median step time (ms)':24}{raw_med * 1e3:14.3f}{job_med * 1e3:16.3f}{job_med / raw_med:14.3f}")
    rs, js = statistics.median(sides["raw"][0]), statistics.median(sides["job"][0])
    print(f"{'to first step (s)':24}{rs:14.3f}{js:16.3f}{js - rs:+14.3f}")
    print(f"{'first step, job / raw':24}{'':14}{'':16}{js / rs:14.3f}  (warm launch: ranks forked, no torchrun)")
    per_rep = [j / r for r, j in zip(sides["raw"][1], sides["job"][1])]
    print(f"steps measured: raw {len(steps['raw'])}, job {len(steps['job'])}; reps {args.reps}; "
          f"per-rep ratios {', '.join(f'{x:.3f}' for x in per_rep)}; load average {os.getloadavg()[0]:.2f}")
    print(result_line({"step_time_ratio": round(job_med / raw_med, 4), "start_overhead_s": round(js - rs, 3),
                       "warm_start_vs_torchrun": round(js / rs, 3),
                       "step_time_ratio_per_rep": [round(x, 4) for x in per_rep], "settings_differ": differ},
                      versions))


if __name__ == "__main__":
    main()
