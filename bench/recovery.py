"""Recovery from a killed worker: time from the kill to the first resumed step, and steps lost.

One embedded cluster (server + 1 agent), one 2-rank job of ``tests/jobs/ft/trainer.py`` with
checkpoints every ``--interval`` steps and ``max_restarts`` = kills. ``--kills`` times, at a
random step of the running attempt, rank 1's script process is SIGKILLed (by pid, found by
``RELAY_JOB_ID``/``RANK`` in /proc). Per kill:

- recovery_s: the kill → the first step the next attempt trained after resuming (its
  metric's timestamp, written by the worker on this machine's clock). It includes the
  platform noticing the death, stopping the peer, placing the new attempt, torchrun starting
  the workers (``import torch``, the process group), and loading the checkpoint.
- steps_lost: the last step attempt k reported minus the step attempt k+1 resumed from.
- phases (from the job's events and metrics): kill → RESTARTING, → the next attempt running
  (its torchrun started), → its checkpoint loaded (the ``resumed_from`` metric).

The baseline printed beside it is what recovery cannot beat: a cold start of the same job's
first attempt (submit → its first step), measured in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/recovery.py [--kills 5] [--interval 5] [--seed 0]

Last line: ``RESULT {"recovery_s_median", "steps_lost_max", "checkpoint_interval", ...}``.
"""
from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import chaos  # noqa: E402
from torchrelay.client.cluster import start_cluster, stop_cluster  # noqa: E402
from torchrelay.client.sdk import RelayClient  # noqa: E402
from torchrelay.spec import JobSpec  # noqa: E402
from _env import SERVER_PACKAGES, header_line, package_versions, result_line  # noqa: E402

JOBS = REPO / "tests" / "jobs" / "ft"


def points(c: RelayClient, job_id: str) -> list:
    out, after = [], 0
    while True:
        page = c.metrics(job_id, after=after)
        if not page.points:
            return out
        out += page.points
        after = page.next_after


def of_attempt(pts: list, attempt: int) -> list:
    return [p for p in pts if p.values.get("attempt") == attempt]


def _s(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f} s"


def _median(rows: list, key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(values), 2) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--interval", type=int, default=5, help="checkpoint.every_steps")
    ap.add_argument("--sleep", type=float, default=0.1, help="seconds per step beyond the compute")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill steps")
    args = ap.parse_args()
    versions = package_versions(SERVER_PACKAGES)
    print(header_line(versions), flush=True)
    rng = random.Random(args.seed)
    epochs = 2 + args.kills  # enough steps for every kill to land mid-run
    home = Path(tempfile.mkdtemp(prefix="relay-bench-recovery-"))
    cluster = start_cluster(1, home=home)
    rows = []
    try:
        with RelayClient(cluster.address) as c:
            spec = JobSpec.parse({"name": "recovery", "entrypoint": f"python trainer.py --sleep {args.sleep} "
                                  f"--epochs {epochs}", "workers": 2, "resources": {"cpu": 1},
                                  "checkpoint": {"every_steps": args.interval, "keep": 2},
                                  "max_restarts": args.kills, "stop_grace_s": 5})
            submitted = time.time()
            job = c.submit(spec, base_dir=JOBS)
            cold_start = None
            for attempt in range(1, args.kills + 1):
                # the attempt's first trained step; then a random step a little later
                first = chaos.wait_until(lambda: [p for p in of_attempt(points(c, job.id), attempt)
                                                  if "loss" in p.values], 180, f"attempt {attempt} training")
                first_step = min(p.step for p in first)
                if cold_start is None:
                    cold_start = min(p.time for p in first) - submitted
                target = first_step + rng.randint(args.interval // 2 + 1, 2 * args.interval)
                chaos.wait_until(lambda: max((p.step for p in of_attempt(points(c, job.id), attempt)
                                              if "loss" in p.values), default=0) >= target, 180,
                                 f"step {target} of attempt {attempt}")
                pid = chaos.worker_pids(job.id, rank=1, attempt=attempt)[1]
                killed_at = time.time()
                chaos.kill(pid, signal.SIGKILL)
                nxt = chaos.wait_until(lambda: [p for p in of_attempt(points(c, job.id), attempt + 1)
                                                if "loss" in p.values], 180, f"attempt {attempt + 1} training")
                pts = points(c, job.id)
                last = max(p.step for p in of_attempt(pts, attempt) if "loss" in p.values)
                resumed = [int(p.values["resumed_from"]) for p in of_attempt(pts, attempt + 1)
                           if "resumed_from" in p.values]
                resumed_from = resumed[0] if resumed else 0
                recovery = min(p.time for p in nxt) - killed_at
                events = [e for e in c.job(job.id).events if e.time >= killed_at]
                restarting = next((e.time for e in events if e.message.startswith("restart ")), None)
                running = next((e.time for e in events if e.message == f"attempt {attempt + 1} running"), None)
                loaded = min((p.time for p in of_attempt(pts, attempt + 1) if "resumed_from" in p.values),
                             default=None)
                phases = {"restarting": restarting, "launched": running, "restored": loaded}
                rows.append({"kill": attempt, "killed_after_step": last, "resumed_from": resumed_from,
                             "steps_lost": last - resumed_from, "recovery_s": recovery,
                             **{k: (v - killed_at if v else None) for k, v in phases.items()}})
                print(f"kill {attempt}: rank 1 SIGKILLed after step {last}; attempt {attempt + 1} resumed from "
                      f"step {resumed_from} (lost {last - resumed_from}); first resumed step "
                      f"{recovery:.2f} s after the kill (RESTARTING at {_s(rows[-1]['restarting'])}, "
                      f"attempt running at {_s(rows[-1]['launched'])}, checkpoint loaded at "
                      f"{_s(rows[-1]['restored'])})", flush=True)
            final = c.wait(job.id, timeout=600)
            print(f"job {job.id}: {final.state.value} after {final.restarts} restarts")
    finally:
        stop_cluster(home)
    recoveries = [r["recovery_s"] for r in rows]
    result = {"recovery_s_median": round(statistics.median(recoveries), 2),
              "recovery_s_max": round(max(recoveries), 2),
              "steps_lost_max": max(r["steps_lost"] for r in rows),
              "checkpoint_interval": args.interval,
              "cold_start_s": round(cold_start, 2),
              "recovery_vs_cold_start": round(statistics.median(recoveries) / cold_start, 2),
              "phase_medians_s": {k: _median(rows, k) for k in ("restarting", "launched", "restored")},
              "final_state": final.state.value}
    print(f"{'':>22}{'median':>10}{'max':>10}")
    print(f"{'recovery (s)':>22}{result['recovery_s_median']:>10}{result['recovery_s_max']:>10}")
    print(f"{'steps lost':>22}{statistics.median(r['steps_lost'] for r in rows):>10}{result['steps_lost_max']:>10}")
    print(f"{'cold start (s)':>22}{result['cold_start_s']:>10}")
    for key, label in (("restarting", "kill→RESTARTING (s)"), ("launched", "kill→attempt running"),
                       ("restored", "kill→checkpoint loaded")):
        print(f"{label:>22}{result['phase_medians_s'][key]!s:>10}")
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
