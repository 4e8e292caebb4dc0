"""Exit-time aborts of 2-rank DDP on gloo: plain torchrun vs the torchrelay launcher's hook.

Runs the same unchanged DDP script (it returns normally after ``destroy_process_group()``,
without the ``gc.collect()`` that would avoid the abort) N times each way, interleaved so
both see the same machine load:

- plain:  ``python -m torch.distributed.run --nproc-per-node 2 ... ddp.py``
- hooked: ``torchrelay.agent.launcher.Launch`` (torchrun + ``torchrelay.agent.worker``)

and counts launches that failed and ranks that died of SIGABRT. For hooked launches it also
counts aborts that still happened after the script returned (rescued by the supervisor).
The natural abort is timing-dependent (it needs a gloo thread to drop the last reference to
a finished collective while the interpreter shuts down), so a second, shorter comparison
runs the same script with an abort forced at exit (as tests/integration/test_exit_abort.py
does), which shows the difference whatever the machine's load.

    python bench/exit_abort.py [--runs 20] [--forced-runs 5]

Ends with ``RESULT {"runs": N, "plain_failed": .., "plain_aborted_ranks": ..,
"hooked_failed": .., "hooked_aborted_ranks": .., "hooked_rescued_aborts": ..,
"forced_runs": M, "forced_plain_failed": .., ...}``.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchrelay import wire
from torchrelay.agent.launcher import Launch, pick_free_port
from _env import TRAINING_PACKAGES, header_line, package_versions, result_line

DDP_SCRIPT = '''
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(30):
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"rank {dist.get_rank()} done, loss {loss.item():.3f}", flush=True)
dist.destroy_process_group()
'''

# The same training, then an object that aborts when the exit-time collection frees it: the
# failure after return, every time (as in tests/integration/test_exit_abort.py).
FORCED_SUFFIX = '''
import gc, os
class AbortsWhenCollected:
    def __init__(self):
        self.cycle = self
    def __del__(self, _abort=os.abort):
        _abort()
gc.disable()
AbortsWhenCollected()
'''

# one entry per failed rank in torchrun's failure summary: "exitcode  : -6 (pid: 123)"
_ABORT_RE = re.compile(r"exitcode\s*:\s*-6\s*\(pid")


def run_plain(workdir: Path, script: str) -> tuple[bool, int]:
    """One plain torchrun launch: (failed, ranks that died of SIGABRT)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(pick_free_port()),
           "--max-restarts", "0", script]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300, start_new_session=True)
    output = proc.stdout + proc.stderr
    return proc.returncode != 0, len(_ABORT_RE.findall(output))


def run_hooked(workdir: Path, script: str, index: int) -> tuple[bool, int, int]:
    """One launch through the agent's launcher: (failed, aborted ranks, rescued aborts)."""
    assignment = wire.LaunchAssignment(
        launch_id=f"bench-{os.getpid()}-{script}-{index}", job_id="bench", attempt=0,
        desired="run", node_rank=0, nnodes=1, nproc_per_node=2, world_size=2, rank_offset=0,
        entrypoint=["python", script], bundle=None, store_url=str(workdir / "store"),
        job_store_prefix="jobs/bench")
    launch = Launch(assignment, code_dir=workdir, run_dir=workdir / f"run-{script}-{index}",
                    base_env=dict(os.environ, OMP_NUM_THREADS="1"))
    launch.start("127.0.0.1", pick_free_port())
    status = launch.wait(timeout=300) or launch.stop(grace_s=5)
    aborted = sum(1 for r in status.ranks if r.signal == 6 and not r.returned)
    rescued = sum(1 for r in status.ranks if r.signal == 6 and r.returned)
    return not status.succeeded, aborted, rescued


def compare(workdir: Path, script: str, runs: int, label: str) -> dict[str, int]:
    """``runs`` interleaved plain/hooked launches of ``script``; prints a row per pair."""
    totals = {"plain_failed": 0, "plain_aborted_ranks": 0, "hooked_failed": 0,
              "hooked_aborted_ranks": 0, "hooked_rescued_aborts": 0}
    print(f"{label}: {'run':>4} {'plain torchrun':>16} {'relay launcher':>26}")
    for index in range(runs):
        started = time.monotonic()
        p_failed, p_aborts = run_plain(workdir, script)
        h_failed, h_aborts, h_rescued = run_hooked(workdir, script, index)
        totals["plain_failed"] += p_failed
        totals["plain_aborted_ranks"] += p_aborts
        totals["hooked_failed"] += h_failed
        totals["hooked_aborted_ranks"] += h_aborts
        totals["hooked_rescued_aborts"] += h_rescued
        plain = f"{'FAILED' if p_failed else 'ok'} ({p_aborts} abrt)"
        hooked = f"{'FAILED' if h_failed else 'ok'} ({h_aborts} abrt, {h_rescued} rescued)"
        print(f"{label}: {index:>4} {plain:>16} {hooked:>26}   {time.monotonic() - started:.1f}s",
              flush=True)
    print(f"{label}: plain torchrun {totals['plain_failed']}/{runs} launches failed "
          f"({totals['plain_aborted_ranks']} ranks aborted); relay launcher "
          f"{totals['hooked_failed']}/{runs} failed ({totals['hooked_aborted_ranks']} ranks aborted, "
          f"{totals['hooked_rescued_aborts']} aborts after return rescued)", flush=True)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20,
                        help="launches per side of the unchanged DDP script (default 20)")
    parser.add_argument("--forced-runs", type=int, default=5,
                        help="launches per side of the same script with a forced abort at exit (default 5)")
    args = parser.parse_args()
    versions = package_versions(TRAINING_PACKAGES)
    print(header_line(versions), flush=True)
    if args.runs < 0 or args.forced_runs < 0:
        parser.error(f"--runs {args.runs} / --forced-runs {args.forced_runs}: give counts >= 0")
    with tempfile.TemporaryDirectory(prefix="relay-exit-abort-") as tmp:
        workdir = Path(tmp)
        (workdir / "ddp.py").write_text(DDP_SCRIPT)
        (workdir / "ddp_forced.py").write_text(DDP_SCRIPT + FORCED_SUFFIX)
        natural = compare(workdir, "ddp.py", args.runs, "natural")
        forced = compare(workdir, "ddp_forced.py", args.forced_runs, "forced")
    print(result_line({"runs": args.runs, **natural, "forced_runs": args.forced_runs,
                       **{f"forced_{k}": v for k, v in forced.items()}}, versions))


if __name__ == "__main__":
    main()
