"""Recovery from a killed worker: time from the kill to the first resumed step, and steps lost,
three ways side by side in one run: the job restarted with its ranks through torchrun (fresh
interpreters, as before: ``RELAY_FRESH_INTERPRETER=1``), restarted with its ranks forked from
the agent's warm zygote (the default), and an elastic job whose survivors go on.

One embedded cluster (server + 1 agent). Restarts: per side one 2-rank job of
``tests/jobs/ft/trainer.py`` with checkpoints every ``--interval`` steps and ``max_restarts`` =
kills. ``--kills`` times, at a random step of the running attempt, rank 1's script process is
SIGKILLed (by pid: ``tests/chaos.py``). Elastic: one 3-worker job of
``tests/jobs/elastic/train.py`` (``elastic: {min_workers: 2, max_workers: 3}``), member 2
SIGKILLed at its 4th step; recovery is the kill -> the survivors' first step in the new
membership, steps lost are the steps they had completed minus the step they went on from.
The peer for the elastic figure is torchft (``bench/_torchft_worker.py``: the same model,
data, workers and pace through torchft's Manager on gloo, its lighthouse in this process),
killed and measured the same way.
Per restart kill:

- recovery_s: the kill → the first step the next attempt trained after resuming (its
  metric's timestamp, written by the worker on this machine's clock). It includes the
  platform noticing the death, stopping the peer, placing the new attempt, torchrun starting
  the workers (``import torch``, the process group), and loading the checkpoint.
- steps_lost: the last step attempt k reported minus the step attempt k+1 resumed from.
- phases (from the job's events and metrics): kill → RESTARTING, → the next attempt running
  (its torchrun started), → its checkpoint loaded (the ``resumed_from`` metric).

The baseline printed beside it is what recovery cannot beat: a cold start of the same job's
first attempt (submit → its first step), measured in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/recovery.py [--kills 3] [--interval 5] [--seed 0]

Last line: ``RESULT {"recovery_warm_s", "recovery_torchrun_s", "recovery_elastic_s",
"elastic_steps_lost", "steps_lost_max", ...}``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
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


def restart_kills(c: RelayClient, args: argparse.Namespace, rng: random.Random, *, fresh: bool) -> tuple[list, float]:
    """``args.kills`` kills of rank 1 of one job (each restarts it from its checkpoint); the
    rows and the cold start (submit -> first step). ``fresh``: the job asks for fresh
    interpreters (torchrun, as before warm launches)."""
    epochs = 4 * (args.kills + 1)  # every kill lands mid-run, also when restarts take a second
    spec = JobSpec.parse({"name": "recovery", "entrypoint": f"python trainer.py --sleep {args.sleep} "
                          f"--epochs {epochs}", "workers": 2, "resources": {"cpu": 1},
                          "checkpoint": {"every_steps": args.interval, "keep": 2},
                          "max_restarts": args.kills, "stop_grace_s": 5,
                          "env": {"RELAY_FRESH_INTERPRETER": "1" if fresh else "0"}})
    submitted = time.time()
    job = c.submit(spec, base_dir=JOBS)
    cold_start, rows = None, []
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
        if not chaos.kill(pid, signal.SIGKILL):
            raise SystemExit(f"rank 1 of attempt {attempt} (pid {pid}) was gone before the kill; give more --epochs")
        nxt = chaos.wait_until(lambda: [p for p in of_attempt(points(c, job.id), attempt + 1)
                                        if "loss" in p.values], 180, f"attempt {attempt + 1} training")
        rows.append(_restart_row(c, job.id, attempt, killed_at, nxt))
        print(f"{'torchrun' if fresh else 'warm'} kill {attempt}: lost {rows[-1]['steps_lost']} steps; first resumed "
              f"step {rows[-1]['recovery_s']:.2f} s after the kill (RESTARTING at {_s(rows[-1]['restarting'])}, "
              f"attempt running at {_s(rows[-1]['launched'])}, checkpoint loaded at {_s(rows[-1]['restored'])})",
              flush=True)
    final = c.wait(job.id, timeout=600)
    print(f"job {job.id}: {final.state.value} after {final.restarts} restarts", flush=True)
    return rows, cold_start


def _restart_row(c: RelayClient, job_id: str, attempt: int, killed_at: float, nxt: list) -> dict:
    pts = points(c, job_id)
    last = max(p.step for p in of_attempt(pts, attempt) if "loss" in p.values)
    resumed = [int(p.values["resumed_from"]) for p in of_attempt(pts, attempt + 1) if "resumed_from" in p.values]
    resumed_from = resumed[0] if resumed else 0
    events = [e for e in c.job(job_id).events if e.time >= killed_at]
    restarting = next((e.time for e in events if e.message.startswith("restart ")), None)
    running = next((e.time for e in events if e.message == f"attempt {attempt + 1} running"), None)
    loaded = min((p.time for p in of_attempt(pts, attempt + 1) if "resumed_from" in p.values), default=None)
    phases = {"restarting": restarting, "launched": running, "restored": loaded}
    return {"kill": attempt, "killed_after_step": last, "resumed_from": resumed_from,
            "steps_lost": last - resumed_from, "recovery_s": min(p.time for p in nxt) - killed_at,
            **{k: (v - killed_at if v else None) for k, v in phases.items()}}


def elastic_kill(c: RelayClient, scratch: Path) -> dict:
    """One elastic 3-worker job (``tests/jobs/elastic/train.py``, min 2): member 2 SIGKILLed at
    its 4th step; the survivors' first step after it, and the steps they lost."""
    out = scratch / "elastic-out"
    out.mkdir()
    spec = JobSpec.parse({"name": "elastic", "entrypoint": "python train.py --epochs 3 --step-sleep 0.1",
                          "workers": 3, "resources": {"cpu": 0.5}, "env": {"OUT": str(out)},
                          "strategy": {"kind": "ddp", "elastic": {"min_workers": 2, "max_workers": 3}}})
    job = c.submit(spec, base_dir=REPO / "tests" / "jobs" / "elastic")

    def lines(member: int) -> list[dict]:
        path = out / f"member-{member}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    chaos.wait_until(lambda: len(lines(2)) >= 4, 180, "member 2's 4th step")
    pid = chaos.worker_pids(job.id, rank=2)[2]
    killed_at = time.time()
    done_before = max(x["step"] for m in (0, 1) for x in lines(m) if x["time"] < killed_at) + 1
    chaos.kill(pid, signal.SIGKILL)
    final = c.wait(job.id, timeout=300)
    after = [x for m in (0, 1) for x in lines(m) if x["epoch"] >= 1]
    first = min(after, key=lambda x: x["time"])
    survivors_pids = {m: {x["pid"] for x in lines(m)} for m in (0, 1)}
    row = {"recovery_s": first["time"] - killed_at, "steps_lost": done_before - first["step"],
           "restarted_survivors": sum(len(p) > 1 for p in survivors_pids.values()), "final_state": final.state.value}
    print(f"elastic kill: survivors' first step {row['recovery_s']:.3f} s after the kill, resumed at step "
          f"{first['step']} with {done_before} done before it (lost {row['steps_lost']}); survivors restarted: "
          f"{row['restarted_survivors']}; job {final.state.value}", flush=True)
    return row


def torchft_kill(scratch: Path) -> dict | None:
    """The peer: the same model, data, 3 workers and step pace through torchft (its lighthouse
    in this process, one replica group of one worker each, gloo); replica 2 SIGKILLed at its
    4th committed step; the survivors' first step committed without it. None when torchft is
    not installed (``make venv`` installs it)."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        print(f"torchft: not measured ({exc}); pip install torchft==0.2.0", flush=True)
        return None
    out = scratch / "torchft-out"
    out.mkdir()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)
    env = {**os.environ, "OUT": str(out), "TORCHFT_LIGHTHOUSE": lighthouse.address(), "OMP_NUM_THREADS": "1",
           "RUST_LOG": "warn"}
    log = open(out / "workers.log", "ab")
    procs = [subprocess.Popen([sys.executable, str(REPO / "bench" / "_torchft_worker.py"), str(i), "3", "48", "0.1"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
             for i in range(3)]

    def lines(member: int) -> list[dict]:
        path = out / f"member-{member}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    try:
        chaos.wait_until(lambda: len(lines(2)) >= 4, 180, "torchft replica 2's 4th step")
        killed_at = time.time()
        done_before = max(x["step"] for m in (0, 1) for x in lines(m) if x["time"] < killed_at) + 1
        chaos.kill(procs[2].pid, signal.SIGKILL)
        for proc in procs[:2]:
            proc.wait(timeout=300)
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        log.close()
        lighthouse.shutdown()
    after = [x for m in (0, 1) for x in lines(m) if x["time"] > killed_at and x["participants"] == 2]
    first = min(after, key=lambda x: x["time"])
    row = {"recovery_s": first["time"] - killed_at, "steps_lost": done_before - first["step"],
           "restarted_survivors": sum(len({x["pid"] for x in lines(m)}) > 1 for m in (0, 1))}
    print(f"torchft kill: survivors' first step without replica 2 {row['recovery_s']:.3f} s after the kill, "
          f"step {first['step']} with {done_before} done before it (lost {row['steps_lost']})", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--interval", type=int, default=5, help="checkpoint.every_steps")
    ap.add_argument("--sleep", type=float, default=0.1, help="seconds per step beyond the compute")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill steps")
    args = ap.parse_args()
    versions = package_versions((*SERVER_PACKAGES, "torchft"))  # torchft: the elastic figure's peer
    print(header_line(versions), flush=True)
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="relay-bench-recovery-"))
    os.environ["RELAY_HOME"] = str(home)  # chaos finds this cluster's processes only (every cluster has a job-2)
    cluster = start_cluster(1, home=home)
    sides = {}
    try:
        with RelayClient(cluster.address) as c:
            for fresh in (True, False):  # torchrun (before) first: the warm side then finds its zygote warm too
                sides["torchrun" if fresh else "warm"] = restart_kills(c, args, rng, fresh=fresh)
            elastic = elastic_kill(c, home)
    finally:
        stop_cluster(home)
    peer = torchft_kill(home)
    med = {side: statistics.median(r["recovery_s"] for r in rows) for side, (rows, _) in sides.items()}
    ft = (f"{peer['recovery_s']:>10.3f}", f"{peer['steps_lost']:>10}") if peer else (f"{'-':>10}", f"{'-':>10}")
    print(f"{'':34}{'torchrun':>10}{'warm':>10}{'elastic':>10}{'torchft':>10}")
    print(f"{'kill -> first resumed step (s)':34}{med['torchrun']:>10.2f}{med['warm']:>10.2f}"
          f"{elastic['recovery_s']:>10.3f}{ft[0]}")
    print(f"{'steps lost (max)':34}{max(r['steps_lost'] for r in sides['torchrun'][0]):>10}"
          f"{max(r['steps_lost'] for r in sides['warm'][0]):>10}{elastic['steps_lost']:>10}{ft[1]}")
    print(f"{'cold start, submit -> step (s)':34}{sides['torchrun'][1]:>10.2f}{sides['warm'][1]:>10.2f}")
    for key, label in (("restarting", "kill -> RESTARTING (s)"), ("launched", "kill -> attempt running (s)"),
                       ("restored", "kill -> checkpoint loaded (s)")):
        print(f"{label:34}{_median(sides['torchrun'][0], key)!s:>10}{_median(sides['warm'][0], key)!s:>10}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    result = {"recovery_warm_s": round(med["warm"], 3), "recovery_torchrun_s": round(med["torchrun"], 3),
              "recovery_elastic_s": round(elastic["recovery_s"], 3), "elastic_steps_lost": elastic["steps_lost"],
              "elastic_restarted_survivors": elastic["restarted_survivors"],
              "recovery_torchft_s": round(peer["recovery_s"], 3) if peer else None,
              "torchft_steps_lost": peer["steps_lost"] if peer else None,
              "elastic_over_torchft": round(elastic["recovery_s"] / peer["recovery_s"], 3) if peer else None,
              "warm_over_torchrun": round(med["warm"] / med["torchrun"], 3),
              "steps_lost_max": max(r["steps_lost"] for rows, _ in sides.values() for r in rows),
              "checkpoint_interval": args.interval,
              "cold_start_s": {side: round(cold, 2) for side, (_, cold) in sides.items()},
              "loadavg_1m": round(os.getloadavg()[0], 2)}
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
