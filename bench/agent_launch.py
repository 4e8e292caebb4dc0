"""Agent launch cost: one no-op job's launch through ``torchrelay.agent.launcher.Launch``,
three ways side by side in one run: direct and forked from the zygote (what the agent does for
a world of one), direct as a fresh process (``zygote=False``), and through torchrun (before);
and a 2-rank launch of a script that imports torch, every rank forked from the warm zygote
(what the agent does for any other launch) against torchrun. ``noop_jobs_per_s`` is the rate
of zygote-forked ``python -c pass`` launches back to back in this process (the agent's side of
a job; through the server see ``bench/scheduler.py``).

For each way, N launches of ``python -c pass`` (and of a hosted ``python noop.py``) one after
the other in this process, as the agent runs them: ``start`` -> ``wait`` -> logs taken.
Reports per launch the median wall time start -> exit seen, the CPU of this process (the
agent's side: spawn, supervising thread, log tailing, classification) and of the children
(torchrun, supervisor, the job; a forked worker's CPU is the zygote's, counted through
its own children's usage in /proc). CPU survives a loaded machine far better than wall time.

    python bench/agent_launch.py [--launches 20] [--torchrun-launches 3]

Prints rows, then ``RESULT {json}``.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrelay import wire  # noqa: E402
from torchrelay.agent import launcher  # noqa: E402
from torchrelay.agent.launcher import Launch, pick_free_port  # noqa: E402
from torchrelay.agent.zygote import Zygote  # noqa: E402
from _env import TRAINING_PACKAGES, header_line, package_versions, result_line  # noqa: E402


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _zygote_cpu(zygote: Zygote | None) -> float:
    """CPU seconds of the zygote and its reaped children (the forked workers)."""
    if zygote is None or zygote.pid is None:
        return 0.0
    fields = open(f"/proc/{zygote.pid}/stat").read().rsplit(") ", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def run_launches(n: int, entrypoint: list[str], tmp: Path, *, direct: bool, zygote: Zygote | None = None,
                 nproc: int = 1, warm_zygote: Zygote | None = None) -> dict:
    code = tmp / "code"
    code.mkdir(exist_ok=True)
    (code / "noop.py").write_text("pass\n")
    walls, failed = [], 0
    cpu_of_zygotes = lambda: _zygote_cpu(zygote) + _zygote_cpu(warm_zygote)  # noqa: E731
    self_cpu0, child_cpu0, zygote_cpu0 = time.process_time(), _children_cpu(), cpu_of_zygotes()
    began = time.perf_counter()
    with _direct_as(direct):
        for i in range(n):
            assignment = wire.LaunchAssignment(
                launch_id=f"bench-{os.getpid()}-{direct}-{i}-{time.monotonic_ns()}", job_id="bench", attempt=0,
                desired="run", node_rank=0, nnodes=1, nproc_per_node=nproc, world_size=nproc, rank_offset=0,
                entrypoint=entrypoint, bundle=None, store_url=str(tmp / "store"), job_store_prefix="jobs/bench")
            launch = Launch(assignment, code_dir=code, run_dir=tmp / assignment.launch_id,
                            relay_address="http://127.0.0.1:9", zygote=zygote, warm_zygote=warm_zygote)
            started = time.perf_counter()
            launch.start("127.0.0.1", pick_free_port())
            status = launch.wait(timeout=120)
            walls.append(time.perf_counter() - started)
            launch.take_logs()
            if status is None or not status.succeeded:
                failed += 1
                launch.stop(grace_s=1)
    elapsed = time.perf_counter() - began
    self_ms = (time.process_time() - self_cpu0) / n * 1e3
    child_ms = (_children_cpu() - child_cpu0 + cpu_of_zygotes() - zygote_cpu0) / n * 1e3
    return {"wall_s_median": statistics.median(walls), "agent_cpu_ms": self_ms, "children_cpu_ms": child_ms,
            "failed": failed, "launches_per_s": n / elapsed}


class _direct_as:
    """Force every launch through torchrun (``direct=False``) or leave the launcher's choice."""

    def __init__(self, direct: bool):
        self.patch = None if direct else mock.patch.object(launcher, "is_direct", lambda a: False)

    def __enter__(self):
        if self.patch:
            self.patch.start()

    def __exit__(self, *exc):
        if self.patch:
            self.patch.stop()


def two_rank_rows(args: argparse.Namespace, tmp: Path) -> dict:
    """A 2-rank launch of a hosted no-op script (``import torch`` and return), both ranks forked
    from the warm zygote against torchrun, one after the other in this process."""
    (tmp / "code").mkdir(exist_ok=True)
    (tmp / "code" / "torch_noop.py").write_text("import torch\n")
    warm = Zygote(env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}, preload=("torch",))
    rows = {}
    try:
        run_launches(1, ["python", "torch_noop.py"], tmp, direct=True, nproc=2, warm_zygote=warm)  # warm it up
        for way, n, zyg in (("warm", args.launches, warm), ("torchrun", args.torchrun_launches, None)):
            row = run_launches(n, ["python", "torch_noop.py"], tmp, direct=True, nproc=2, warm_zygote=zyg)
            rows[way] = row
            print(f"{'2 ranks, import torch':24s} {way:8s} x{n:<3d} start->exit median "
                  f"{row['wall_s_median'] * 1e3:7.1f} ms; CPU per launch: agent {row['agent_cpu_ms']:6.1f} ms, "
                  f"workers {row['children_cpu_ms']:7.1f} ms; failed {row['failed']}", flush=True)
    finally:
        warm.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20, help="direct launches per entrypoint")
    parser.add_argument("--torchrun-launches", type=int, default=3, help="torchrun launches per entrypoint")
    args = parser.parse_args()
    versions = package_versions(TRAINING_PACKAGES)
    print(header_line(versions), flush=True)
    rows = {}
    zygote = Zygote(env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        with tempfile.TemporaryDirectory(prefix="relay-agent-bench-") as tmp:
            run_launches(1, ["python", "-c", "pass"], Path(tmp), direct=True, zygote=zygote)  # start it
            for name, entrypoint in (("python -c pass", ["python", "-c", "pass"]),
                                     ("python noop.py", ["python", "noop.py"])):
                for way, direct, n, zyg in (("zygote", True, args.launches, zygote),
                                            ("direct", True, args.launches, None),
                                            ("torchrun", False, args.torchrun_launches, None)):
                    row = run_launches(n, entrypoint, Path(tmp), direct=direct, zygote=zyg)
                    rows[(name, way)] = row
                    print(f"{name:15s} {way:8s} x{n:<3d} start->exit median {row['wall_s_median'] * 1e3:7.1f} ms; "
                          f"CPU per launch: agent {row['agent_cpu_ms']:6.1f} ms, "
                          f"workers {row['children_cpu_ms']:7.1f} ms; "
                          f"failed {row['failed']}")
            ranks2 = two_rank_rows(args, Path(tmp))
    finally:
        zygote.close()
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (2 shared cores: wall times are noisy, CPU less so)")
    total = lambda r: r["agent_cpu_ms"] + r["children_cpu_ms"]  # noqa: E731
    c = {way: rows[("python -c pass", way)] for way in ("zygote", "direct", "torchrun")}
    result = {
        "zygote_cpu_ms_per_noop": round(total(c["zygote"]), 1),
        "direct_cpu_ms_per_noop": round(total(c["direct"]), 1),
        "torchrun_cpu_ms_per_noop": round(total(c["torchrun"]), 1),
        "cpu_ratio_torchrun_over_zygote": round(total(c["torchrun"]) / total(c["zygote"]), 1),
        "cpu_ratio_direct_over_zygote": round(total(c["direct"]) / total(c["zygote"]), 2),
        "zygote_agent_cpu_ms": round(c["zygote"]["agent_cpu_ms"], 1),
        "wall_ms_median": {way: round(r["wall_s_median"] * 1e3, 1) for way, r in c.items()},
        "hosted_script_cpu_ms": {way: round(total(rows[("python noop.py", way)]), 1) for way in c},
        "noop_jobs_per_s": round(c["zygote"]["launches_per_s"], 1),
        "two_rank_cpu_ms": {way: round(total(r), 1) for way, r in ranks2.items()},
        "two_rank_wall_ms_median": {way: round(r["wall_s_median"] * 1e3, 1) for way, r in ranks2.items()},
        "two_rank_cpu_ratio_torchrun_over_warm": round(total(ranks2["torchrun"]) / total(ranks2["warm"]), 1),
        "loadavg_1m": round(load[0], 2),
    }
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
