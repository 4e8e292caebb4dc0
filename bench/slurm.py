"""The Slurm executor against the hand-written ``sbatch`` (and torchx's Slurm scheduler), on a
private Slurm 22.05 cluster on this host (``tests/services/slurm.py``: munge, slurmctld, two
slurmd n1 and n2).

a) Start: submit -> first training step of the same two-node torchrun script, one rank per
   node, N times each, alternating:
   - ours: a job spec with ``executor: slurm`` submitted to a ``ClusterService`` with a
     ``SlurmExecutor`` (what ``relay submit`` reaches), through sbatch, srun and the agent's
     launcher on each node;
   - by hand: ``sbatch`` of a batch script whose ``srun`` runs torchrun on each node;
   - torchx (``torchx run -s slurm dist.ddp -j 2x1 …``), when ``torchx`` is importable here
     and its job starts (see docs/slurm.md for why it may not).
   The first step's time is the wall clock the script prints at its first step (this host's
   clock for all), so reading the result costs nothing to either side.
b) Polling: ``--jobs`` (100) Slurm jobs running at once through the executor, then
   ``--polls`` status polls: Slurm commands per poll interval (squeue, sacct), whatever the
   number of jobs.

    OMP_NUM_THREADS=1 python bench/slurm.py [--reps 3] [--jobs 100] [--polls 5] [--torchx PATH]

Prints rows, then ``RESULT {"slurm_start_overhead_s", "slurm_calls_per_poll", ...}``.
Needs root (the cluster's daemons run as root).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from _env import header_line, package_versions, result_line  # noqa: E402
from services.slurm import SlurmCluster  # noqa: E402
from torchrelay.client.bundle import pack_dir  # noqa: E402
from torchrelay.server.executors.slurm import SlurmConfig, SlurmExecutor  # noqa: E402
from torchrelay.server.service import ClusterService  # noqa: E402

SCRIPT = """\
import os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.Linear(8, 1)
loss = model(torch.randn(4, 8)).pow(2).mean()
loss.backward()
for p in model.parameters():
    dist.all_reduce(p.grad)
print(f"FIRST_STEP rank={dist.get_rank()} t={time.time():.3f}", flush=True)
dist.destroy_process_group()
"""

HAND_SBATCH = """\
#!/bin/bash
#SBATCH --job-name=hand
#SBATCH --partition={partition}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}
export MASTER_PORT=$({python} -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
srun --ntasks-per-node=1 bash -c 'exec {python} -m torch.distributed.run --nnodes 2 --node-rank $SLURM_NODEID \\
  --nproc-per-node 1 --master-addr $SLURM_LAUNCH_NODE_IPADDR --master-port $MASTER_PORT {script}'
"""


def _first_step(text: str) -> float | None:
    times = [float(line.rsplit("t=", 1)[1]) for line in text.splitlines() if "FIRST_STEP" in line]
    return min(times) if len(times) >= 2 else None


def _wait_for(read, timeout_s: float = 180) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = read()
        if found is not None:
            return found
        time.sleep(0.05)
    raise TimeoutError("no first step seen")


def by_hand(cluster: SlurmCluster, work: Path, i: int) -> float:
    out = work / f"hand-{i}.out"
    script = work / f"hand-{i}.sbatch"
    script.write_text(HAND_SBATCH.format(partition=cluster.partition, out=out, python=sys.executable,
                                         script=work / "code" / "first_step.py"))
    t0 = time.time()
    cluster.run("sbatch", "--parsable", str(script))
    first = _wait_for(lambda: _first_step(out.read_text()) if out.exists() else None)
    _wait_idle(cluster)
    return first - t0


def ours(service: ClusterService, digest: str, i: int) -> float:
    t0 = time.time()
    info = service.submit({"name": f"ours-{i}", "entrypoint": "python first_step.py", "executor": "slurm",
                           "nodes": 2, "workers_per_node": 1, "resources": {"cpu": 1}}, digest, None)
    first = _wait_for(lambda: _first_step("\n".join(x.text for x in service.logs(info.id).lines)))
    _wait_for(lambda: True if service.get_job(info.id).state.terminal else None)
    return first - t0


def find_torchx(given: str | None) -> str | None:
    found = given or shutil.which("torchx") or str(Path(sys.executable).with_name("torchx"))
    return found if Path(found).exists() else None


def torchx_run(cluster: SlurmCluster, work: Path, torchx: str | None) -> float | str:
    """torchx's own Slurm scheduler on the same script (its ``dist.ddp``: torchrun with c10d
    rendezvous at the first node's host name, one heterogeneous component per node), or why
    it could not run."""
    if torchx is None:
        return "torchx is not installed here (pip install torchx, or --torchx PATH)"
    # torchrun (torch) comes from this interpreter's environment, as the other two sides use it
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    t0 = time.time()
    done = subprocess.run([torchx, "run", "-s", "slurm", "-cfg", f"partition={cluster.partition}",
                           "dist.ddp", "-j", "2x1", "--script", "first_step.py"],
                          cwd=work / "code", env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    found = re.search(r"slurm://torchx/(\d+)", output) or re.search(r"'-j', '(\d+)'", output)
    if found is None:
        return f"torchx run failed ({done.returncode}): {output.strip()[-300:]}"
    slurm_id = found.group(1)
    if done.returncode != 0:  # torchx 0.7 asks sacct about the job it submitted: without accounting that fails
        print(f"   (torchx run exited {done.returncode} after submitting Slurm job {slurm_id}: "
              f"{output.strip().splitlines()[-1][:160]})")
    try:
        first = _wait_for(lambda: _torchx_first(work, slurm_id), timeout_s=90)
    except TimeoutError:
        state = cluster.run("squeue", "-h", "-t", "all", "-j", slurm_id, "-o", "%T %r", check=False).stdout.strip()
        cluster.run("scancel", slurm_id, check=False)
        return f"torchx's job {slurm_id} never reached its first step (Slurm: {state or 'gone'})"
    _wait_idle(cluster)
    return first - t0


def _torchx_first(work: Path, slurm_id: str) -> float | None:
    texts = [p.read_text(errors="replace") for p in work.rglob(f"*{slurm_id}*") if p.is_file()]
    return _first_step("\n".join(texts))


def _wait_idle(cluster: SlurmCluster) -> None:
    _wait_for(lambda: True if not cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.strip() else None, 120)


def part_a(cluster: SlurmCluster, service: ClusterService, work: Path, reps: int, torchx: str | None) -> dict:
    code = work / "code"
    code.mkdir()
    (code / "first_step.py").write_text(SCRIPT)
    blob, digest = pack_dir(code)
    service.put_bundle(digest, blob)
    times: dict[str, list] = {"hand": [], "ours": [], "torchx": []}
    for i in range(reps):
        times["hand"].append(by_hand(cluster, work, i))
        times["ours"].append(ours(service, digest, i))
        times["torchx"].append(torchx_run(cluster, work, torchx))
    print("a) submit -> first training step, 2 nodes × 1 rank (seconds)")
    rows = {}
    for name, values in times.items():
        numbers = [v for v in values if isinstance(v, float)]
        if numbers:
            rows[name] = statistics.median(numbers)
            print(f"   {name:8s} median {rows[name]:6.2f}  runs {', '.join(f'{v:.2f}' for v in numbers)}")
        elif values:
            print(f"   {name:8s} {values[0]}")
    overhead = rows["ours"] - rows["hand"]
    print(f"   ours - by hand: {overhead:+.2f} s (goal ≤ 1.5 s)")
    if "torchx" in rows:
        print(f"   ours / torchx: {rows['ours'] / rows['torchx']:.2f}× (goal ≤ 1)")
    return {"slurm_start_overhead_s": round(overhead, 3), "start_s_ours": round(rows["ours"], 3),
            "start_s_hand": round(rows["hand"], 3),
            "start_s_torchx": round(rows["torchx"], 3) if "torchx" in rows else None,
            "torchx_note": next((v for v in times["torchx"] if isinstance(v, str)), None)}


def part_b(service: ClusterService, executor: SlurmExecutor, cluster: SlurmCluster, jobs: int, polls: int) -> dict:
    ids = [service.submit({"name": f"sleeper-{i}", "entrypoint": "sleep 600", "executor": "slurm",
                           "resources": {"cpu": 1}, "stop_grace_s": 0}, None, None).id for i in range(jobs)]
    deadline = time.monotonic() + 600
    while sum(service.get_job(j).state.value == "RUNNING" for j in ids) < jobs:
        if time.monotonic() > deadline:
            raise TimeoutError("the jobs did not all start")
        time.sleep(1)
    before, polls_before = dict(executor.commands.calls), executor.polls
    started = time.monotonic()
    executor.stop()  # the background loop's polls would mix in; step by hand, one poll each
    for _ in range(polls):
        executor.step(poll=True)
    elapsed = time.monotonic() - started
    calls = {k: executor.commands.calls[k] - before.get(k, 0) for k in ("squeue", "sacct", "sinfo")}
    done_polls = executor.polls - polls_before
    per_poll = sum(calls.values()) / done_polls
    print(f"b) {jobs} running Slurm jobs, {done_polls} status polls: squeue {calls['squeue']}, sacct {calls['sacct']}, "
          f"sinfo {calls['sinfo']} -> {per_poll:.2f} Slurm calls per poll interval (goal ≤ 2); "
          f"{elapsed / done_polls * 1000:.0f} ms a step")
    executor.start()
    for job in ids:
        service.cancel(job, checkpoint=False)
    _wait_for(lambda: True if all(service.get_job(j).state.terminal for j in ids) else None, 300)
    return {"slurm_calls_per_poll": round(per_poll, 3), "slurm_jobs_polled": jobs, "poll_step_ms":
            round(elapsed / done_polls * 1000, 1)}


def resolvable_node_names() -> tuple[str, str]:
    """Two names of this host that resolve to a loopback address (torchx's rendezvous goes to
    the first node's name); n1 and n2 when there are not two (torchx's side then fails)."""
    names = [socket.gethostname().split(".")[0]]
    try:
        for line in Path("/etc/hosts").read_text().splitlines():
            fields = line.split("#")[0].split()
            if len(fields) >= 2 and fields[0].startswith("127."):
                names += [n for n in fields[1:] if "." not in n and n != "localhost"]
    except OSError:
        pass
    names = list(dict.fromkeys(names))
    return (names[0], names[1]) if len(names) >= 2 else ("n1", "n2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--polls", type=int, default=5)
    parser.add_argument("--torchx", help="the torchx command (default: on PATH or beside this interpreter); "
                        "it may live in a venv of its own: torchx 0.7 pins urllib3<1.27")
    args = parser.parse_args()
    torchx = find_torchx(args.torchx)
    versions = package_versions(("torch",))
    versions["torchx"] = (subprocess.run([torchx, "--version"], capture_output=True, text=True).stdout.strip()
                          if torchx else "absent")
    reason = SlurmCluster.unavailable()
    if reason:
        sys.exit(f"cannot start a Slurm cluster here: {reason}")
    cluster = SlurmCluster(nodes=resolvable_node_names())
    versions["slurm"] = cluster.run("sinfo", "--version").stdout.strip()
    print(header_line(versions))
    print(f"nodes: {', '.join(cluster.nodes)} (one host)")
    work = Path(tempfile.mkdtemp(prefix="relay-bench-slurm-"))
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        executor = SlurmExecutor(SlurmConfig(partition=cluster.partition, job_root=str(work / "jobs"),
                                             python=sys.executable, jobcomp_path=str(cluster.jobcomp)))
        service = ClusterService(f"sqlite:///{work / 'state.db'}", str(work / "store"), executors=[executor])
        service.start()
        try:
            result = part_a(cluster, service, work, args.reps, torchx)
            if args.jobs:
                result.update(part_b(service, executor, cluster, args.jobs, args.polls))
        finally:
            service.stop()
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
