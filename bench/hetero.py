"""Heterogeneous data parallel: two workers of different speed, plain DDP against balanced.

An embedded cluster of two agents on this machine, one offering ``--cpus 1`` and one
``--cpus 0.5`` (enforced by the agents' cgroups: docs/agent.md; run as root), trains one model
with the same global batch and seed in every run. ``--model charlm`` (the default): the char
LM of examples/charlm (2 blocks, d_model 64, windows of 64 characters of Python's own sources),
global batch 256 windows (16,384 characters a step, as in nanoGPT's shakespeare-char config), 150
steps a run, target loss 2.5; ``--model digits``: the digits CNN of
examples/digits, global batch 128, target loss 0.35 (the digits rows in docs/benchmarks.md). The runs:

- solo: one worker on each agent on its own, with half the global batch: each worker's
  throughput (its time to loss is not comparable: it trains on half the batch). The two solo
  jobs run at the same time (``--solos together``, the default), so each meets the same
  contention for this machine's 2 cores as it does beside the other in the pair; ``--solos
  apart`` runs them one after the other, each with the machine to itself (how the digits rows
  in docs/benchmarks.md ran);
- plain: ``strategy: {kind: ddp}`` on the pair (every rank half the batch: the slow one sets
  the pace);
- balanced: ``strategy: {kind: ddp, balance: throughput}`` on the pair;
- balanced local_sgd: ``strategy: {kind: local_sgd, every: 8, balance: throughput}`` on the pair,
  right after the second solos, and compared with them: the same split, with the parameters
  averaged every 8 steps instead of the gradients every step. Beside balanced ddp it shows how
  much of what stands between vs_sum_solo and 1 is the per-step all-reduce, and what a job that
  can train with local SGD gets on such a pair;
- lifted: balanced again, and mid-run the slow agent's CPU quota is raised to 1 cpu (its
  cgroup, written here): how many steps until its shares settle. The shares and measured
  speeds at each re-measurement are printed.

- equal pair: last, both agents set to 0.75 cpu (the same 1.5 cpu in all), solos, plain ddp,
  solos: what plain DDP reaches against its solo jobs when neither worker waits for a slower
  one. That is the cost of a synchronous step on this machine (the all-reduce, and the jitter of
  two processes sharing 2 cores), which no split recovers: the ceiling for vs_sum_solo here.

The first five run in the order solos, balanced, plain, balanced, solos, and each ratio takes
the mean of a kind's two runs: the solos' and the balanced runs' mean times are then the plain
run's, so a machine that speeds up or slows down steadily during the bench moves every ratio's
two sides alike. Measured on this machine's 2 shared cores: the two solo jobs trained 1,061
samples/s together at the start of a session and 1,263 eight minutes later, with nothing else
running; a balanced run compared with solos from minutes before carried that drift.

Throughput is samples/s of the global batch over the steps after a warm-up, printed with each
rank's mean fraction of a step spent waiting in the all-reduce (after step 20); time to loss is
wall time from the first step until the loss (an exponential average) falls below
``--target-loss``, printed with the step that reached it (the same step in every pair run: one
global batch a step, so a ratio of times there is one of step times). No sleep anywhere in the training code: the speed difference is the cgroup's.
The balanced run's step is then taken apart (``step_budget``): the step at the solo jobs'
speeds, what the pair loses per sample, the split's rounding, the jitter between the ranks, the
all-reduce itself and the rest, in ms and as shares of the step: what stands between
vs_sum_solo and 1.

Why two models, and why 256 windows: every step of synchronous data parallel pays costs of its
own, whatever the split: the all-reduce, a few ms on this machine's gloo
(``bench/step_allreduce.py``), and the jitter of two ranks under 10 ms CPU quota periods, each
waiting for whichever is late this step (about 2 ms each here). The digits CNN's step is 13 ms,
so those are a third of it and bound what any split can reach. The char LM's step at 256
windows is about 160 ms, and they are 2-5 % of it, as in a training step that is mostly
compute; at ``--batch 64`` (the default until 2026-12-06, with ``--steps 300 --lift-steps 400``)
its step is 40 ms, they are a seventh of it, and the equal pair below reaches only 0.84-0.92
of its solo jobs, which bounds vs_sum_solo there (docs/benchmarks.md has the rows of both).

    sudo .venv/bin/python bench/hetero.py [--model charlm|digits] [--steps N] [--batch B]
    sudo .venv/bin/python bench/hetero.py --only lifted --repeat 8

``--only lifted`` runs nothing but the lifted run, ``--repeat`` times on one cluster (a few
minutes for eight): settling is one figure per run and the lift falls at a different point of a
window each time, so comparing two versions of the balancer needs many lifts, not many solos.
It ends with ``RESULT`` holding each of the four settling figures below as a list, one per run.

Ends with ``RESULT {"vs_sum_solo": balanced / (solo fast + solo slow), "vs_equal_split":
balanced / plain, "time_to_loss_ratio": balanced / plain (balanced and solo: the means of their
two runs), "resettle_steps": steps from the lift to the last re-split (balance_every K is printed
beside it), "first_move_steps": steps from the lift to the first re-split, "settled_idle_gap": after
the last re-split, the difference between the two ranks' mean fraction of a step spent waiting
in the all-reduce (0 when the split leaves neither waiting for the other), "settled_samples_per_s":
the lifted run's throughput after its last re-split (rank 0's report times), "equal_pair_vs_sum_solo":
the equal pair's plain ddp / its solos, "local_sgd_vs_sum_solo": balanced local_sgd / (solo fast +
solo slow) of the second solos, "local_sgd_time_to_loss_ratio": balanced local_sgd / plain ddp}``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import header_line, package_versions, result_line  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EVERY = 20  # balance_every (K)

# What each model's run sets up before the loop: ``train_set`` (a map-style dataset of (x, y)),
# ``model``, ``loss_of(model output, y)`` and the optimizer's learning rate
SETUP = {
    "digits": '''
from model import DigitsCNN, load_split
train_set, _ = load_split(0)
model, loss_of, lr = DigitsCNN(), F.cross_entropy, 2e-3
''',
    "charlm": '''
from torch.utils.data import TensorDataset
from data import CharCorpus, stdlib_text, text_windows
from model import CharLM, CharLMConfig, lm_loss
corpus = CharCorpus.from_text(stdlib_text())
windows, _ = text_windows(corpus.train, 64)
train_set = TensorDataset(windows[:, :-1], windows[:, 1:])
model, loss_of, lr = CharLM(CharLMConfig(vocab_size=corpus.vocab_size, context=64)), lm_loss, 3e-3
''',
}
MODEL_FILES = {"digits": ("digits/model.py",), "charlm": ("charlm/model.py", "charlm/data.py")}
# charlm: 256 windows of 64 characters, 16,384 characters a step (nanoGPT's shakespeare-char step,
# 64 x 256); at 64 windows a step is 40 ms here and the synchronous step's own costs are a seventh of it
DEFAULTS = {"digits": {"batch": 128, "target_loss": 0.35, "steps": 300, "lift_steps": 400},
            "charlm": {"batch": 256, "target_loss": 2.5, "steps": 150, "lift_steps": 200}}

TRAIN = '''
import argparse, json, time
import torch, torch.nn.functional as F
import torchrelay.train as rt

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int); p.add_argument("--batch", type=int); p.add_argument("--target-loss", type=float)
args = p.parse_args()
ctx = rt.init()
torch.manual_seed(0)
{setup}
model, optimizer = rt.prepare(model, torch.optim.Adam(model.parameters(), lr=lr))
loader = rt.shard(train_set, batch_size=args.batch // ctx.world_size, seed=0)
step, epoch, warm, ema, reached, reached_step = 0, 0, 10, None, None, None
start = t_warm = time.perf_counter()
while step < args.steps:
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        step += 1
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if reached is None and ema < args.target_loss:
            reached, reached_step = time.perf_counter() - start, step
        if step == warm:
            t_warm = time.perf_counter()
        rt.report(step, loss=loss.item(), batch=len(y))
        if step >= args.steps:
            break
    epoch += 1
elapsed = time.perf_counter() - t_warm
if ctx.is_main:
    print("BENCH " + json.dumps({"samples_per_s": (args.steps - warm) * args.batch / elapsed,
                                 "time_to_loss_s": reached, "reached_step": reached_step}), flush=True)
rt.shutdown()
'''


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="steps of each run (charlm: 150; digits: 300)")
    parser.add_argument("--lift-steps", type=int, default=None,
                        help="steps of the run whose slow worker is lifted (charlm: 200; digits: 400)")
    parser.add_argument("--model", choices=sorted(SETUP), default="charlm")
    parser.add_argument("--solos", choices=("together", "apart"), default="together",
                        help="run the two solo jobs at once (the pair's contention) or one after the other")
    parser.add_argument("--batch", type=int, default=None, help="the global batch (charlm: 256 windows; digits: 128)")
    parser.add_argument("--target-loss", type=float, default=None, help="charlm: 2.5; digits: 0.35")
    parser.add_argument("--only", choices=("all", "lifted"), default="all",
                        help="every run (the default), or only the lifted run, --repeat times")
    parser.add_argument("--repeat", type=int, default=1, help="with --only lifted: how many lifted runs")
    parser.add_argument("--lift-seed", type=int, default=0,
                        help="run n is lifted at step lift_steps // 3 + a draw in [0, K) seeded by lift-seed + n")
    args = parser.parse_args(argv)
    if args.repeat < 1 or (args.repeat > 1 and args.only != "lifted"):
        parser.error(f"--repeat {args.repeat}: give a count of at least 1, and more than 1 only with --only lifted")
    for name, value in DEFAULTS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def agent_cpu_dir(pid: int) -> Path:
    from torchrelay.agent import cgroups

    return Path(cgroups.detect().dir_of("cpu")) / f"torchrelay-agent-{pid}"


def run_job(client, code: Path, args, *, strategy: dict, workers: int, label: str | None, steps: int,
            on_point=None) -> tuple[dict, list]:
    """Submit one run, follow its metrics (``on_point(point)`` for each), return its BENCH line and points."""
    from torchrelay.spec import JobSpec, JobState

    batch = args.batch if workers == 2 else args.batch // 2  # a solo worker trains the pair's even share
    spec = {"name": f"hetero-{strategy.get('balance', 'plain')}", "workdir": ".", "resources": {"cpu": 0.5},
            "entrypoint": f"python train.py --steps {steps} --batch {batch} --target-loss {args.target_loss}",
            "strategy": strategy}
    spec.update({"nodes": 2, "workers_per_node": 1} if workers == 2 else {"workers": 1, "labels": {"speed": label}})
    info = client.submit(JobSpec.parse(spec), base_dir=code)
    points, after = [], 0
    while True:
        page = client.metrics(info.id, after=after, wait=2)
        after = page.next_after
        for point in page.points:
            points.append(point)
            if on_point:
                on_point(point)
        if page.job_state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED) and not page.points:
            break
    final = client.wait(info.id, timeout=60)
    if final.state != JobState.SUCCEEDED:
        raise RuntimeError(f"{info.id} {final.state.value}: {final.failure}")
    line = next(x.text for x in client.iter_logs(info.id, rank=0) if x.text.startswith("BENCH "))
    row = json.loads(line.split(" ", 1)[1])
    row["idle"] = idle_by_rank(points)
    return row, points


def idle_text(idle: dict[int, float]) -> str:
    """``idle_by_rank``'s figures as "0: 12%, 1: 8%" ("-" when none)."""
    return ", ".join(f"{rank}: {fraction:.0%}" for rank, fraction in idle.items()) or "-"


def idle_by_rank(points: list, after_step: int = 20) -> dict[int, float]:
    """Each rank's mean ``idle_fraction`` (waiting in the all-reduce) over the steps after ``after_step``."""
    fractions: dict[int, list[float]] = {}
    for p in points:
        if p.step > after_step and "idle_fraction" in p.values:
            fractions.setdefault(p.rank, []).append(p.values["idle_fraction"])
    return {rank: sum(f) / len(f) for rank, f in sorted(fractions.items())}


def step_budget(points: list, global_batch: int, samples_per_s: float, solo_sum: float,
                after_step: int = 20) -> dict[str, float] | None:
    """Where a two-rank step's time goes, in ms per step, from each rank's ``compute_s``,
    ``allreduce_wait_s`` and ``share`` (steps after ``after_step`` that both ranks reported).
    The parts add up to the measured step (``global_batch / samples_per_s``):

    - ``solo speeds``: the step if the pair computed at the solo jobs' speeds, with nothing
      lost to working together (``global_batch / solo_sum``: what vs_sum_solo compares with);
    - ``pair slower per sample``: the pair's compute split perfectly at the speeds it measured
      (``global_batch / sum of share / compute``), less the above;
    - ``split off``: the slower rank's mean compute, less that perfect split (the shares'
      rounding to whole samples, and the hysteresis that keeps them);
    - ``jitter``: the mean over steps of the slower rank's compute, less the slower rank's mean:
      each step waits for whichever rank is late this time;
    - ``all-reduce``: the shorter of the two ranks' waits each step (the one that arrived last
      waits only for the all-reduce itself);
    - ``rest``: the remainder (the optimizer's step, the balancer, ``report``).

    None when no step has the figures of both ranks."""
    by_step: dict[int, dict[int, dict]] = {}
    for p in points:
        if p.step > after_step and "compute_s" in p.values and "share" in p.values:
            by_step.setdefault(p.step, {})[p.rank] = p.values
    steps = [s for s in sorted(by_step) if len(by_step[s]) == 2]
    if not steps:
        return None
    n = len(steps)
    compute = {r: sum(by_step[s][r]["compute_s"] for s in steps) / n for r in (0, 1)}
    share = {r: sum(by_step[s][r]["share"] for s in steps) / n for r in (0, 1)}
    perfect = global_batch / sum(share[r] / compute[r] for r in (0, 1))
    slower_mean = max(compute.values())
    slower_each = sum(max(by_step[s][r]["compute_s"] for r in (0, 1)) for s in steps) / n
    floor = sum(min(by_step[s][r]["allreduce_wait_s"] for r in (0, 1)) for s in steps) / n
    step = global_batch / samples_per_s
    solo = global_batch / solo_sum
    parts = {"solo speeds": solo, "pair slower per sample": perfect - solo, "split off": slower_mean - perfect,
             "jitter": slower_each - slower_mean, "all-reduce": floor, "rest": step - slower_each - floor}
    return {name: 1000 * seconds for name, seconds in parts.items()}


def run_solos(address: str, code: Path, args) -> dict[str, dict]:
    """The solo job on each agent (``--solos``: both at once, a client each, or in turn); their BENCH rows."""
    from concurrent.futures import ThreadPoolExecutor

    from torchrelay.client.sdk import RelayClient

    def solo(label: str) -> dict:
        with RelayClient(address) as client:
            return run_job(client, code, args, strategy={"kind": "ddp"}, workers=1, label=label, steps=args.steps)[0]

    labels = ("fast", "slow")
    if args.solos == "apart":
        return {f"solo {label}": solo(label) for label in labels}
    with ThreadPoolExecutor(len(labels)) as pool:
        runs = {label: pool.submit(solo, label) for label in labels}
        return {f"solo {label}": run.result() for label, run in runs.items()}


def settle_steps(points: list, lifted_at: float) -> tuple[int | None, int | None, list]:
    """Steps from the first step after the lift to rank 0's first and to its last change of share
    after it (0 when none), and the steps of those changes; (None, None, []) when no step ran after it."""
    mine = sorted((p for p in points if p.rank == 0 and "share" in p.values), key=lambda p: p.step)
    after = [p for p in mine if p.time >= lifted_at]
    if not after:
        return None, None, []
    changes = [b.step for a, b in zip(mine, mine[1:]) if b.values["share"] != a.values["share"] and b.time >= lifted_at]
    if not changes:
        return 0, 0, []
    return changes[0] - after[0].step, changes[-1] - after[0].step, changes


def rate_after(points: list, step: int, global_batch: int) -> float | None:
    """Samples/s of the global batch over rank 0's steps after ``step`` (the times its reports
    carry); None with fewer than two such steps."""
    mine = sorted((p for p in points if p.rank == 0 and p.step > step), key=lambda p: p.step)
    if len(mine) < 2 or mine[-1].time <= mine[0].time:
        return None
    return (mine[-1].step - mine[0].step) * global_batch / (mine[-1].time - mine[0].time)


def remeasures(points: list) -> list[tuple[int, tuple, tuple]]:
    """(step, shares, measured samples/s), by rank, at each re-measurement where either changed."""
    by_step: dict[int, dict[int, tuple[float, float]]] = {}
    for p in points:
        if "measured_samples_per_s" in p.values and "share" in p.values:
            by_step.setdefault(p.step, {})[p.rank] = (p.values["share"], p.values["measured_samples_per_s"])
    rows = []
    for step in sorted(by_step):
        ranks = by_step[step]
        if len(ranks) == 2:
            rows.append((step, tuple(int(ranks[r][0]) for r in (0, 1)), tuple(round(ranks[r][1]) for r in (0, 1))))
    return [row for i, row in enumerate(rows) if i == 0 or row[1:] != rows[i - 1][1:]]


def set_cpus(agent_pid: int, cpus: float) -> None:
    """Set an agent's CPU quota (its cgroup, as the lift does) to ``cpus``."""
    cpu_dir = agent_cpu_dir(agent_pid)
    period = int((cpu_dir / "cpu.cfs_period_us").read_text())
    (cpu_dir / "cpu.cfs_quota_us").write_text(str(round(cpus * period)))


def equal_pair(cluster, code: Path, args) -> dict[str, float]:
    """Both agents at 0.75 cpu (the same 1.5 cpu in all): solos, plain ddp, solos. Plain ddp over
    the mean of the solo sums: what a synchronous step costs on this machine when no worker waits
    for a slower one, which no split can recover."""
    from torchrelay.client.sdk import RelayClient

    def solo_sum() -> float:
        return sum(row["samples_per_s"] for row in run_solos(cluster.address, code, args).values())

    for pid in cluster.pids[1:3]:
        set_cpus(pid, 0.75)
    sums = [solo_sum()]
    with RelayClient(cluster.address) as client:
        pair = run_job(client, code, args, strategy={"kind": "ddp"}, workers=2, label=None, steps=args.steps)[0]
    sums.append(solo_sum())
    return {"solo_sums": sums, "pair": pair["samples_per_s"], "idle": pair["idle"],
            "ratio": pair["samples_per_s"] / mean(sums)}


BALANCED = {"kind": "ddp", "balance": "throughput", "balance_every": EVERY}
LOCAL_SGD_EVERY = 8  # the spec's default
BALANCED_LOCAL_SGD = {**BALANCED, "kind": "local_sgd", "every": LOCAL_SGD_EVERY}


def lifted_run(cluster, code: Path, args, n: int = 0) -> tuple[dict, dict]:
    """Balanced run ``n`` whose slow agent is lifted to 1 cpu once a step past ``lift_steps // 3``
    plus a draw in [0, K) is seen (seeded by ``--lift-seed`` + n: the lift falls at a different
    point of a window in each run, and at the same one for the same seed, whichever balancer
    runs), and set back to 0.5 cpu after it. Its BENCH row, and a dict of what settling looked
    like (``step`` it was lifted at, ``first_move``, ``resettle``, ``changes``, ``settled_idle``,
    ``settled_rate``, ``points``)."""
    from torchrelay.client.sdk import RelayClient

    set_cpus(cluster.pids[2], 0.5)
    lift = {"at": None, "step": None}
    lift_step = args.lift_steps // 3 + random.Random(args.lift_seed + n).randrange(EVERY)

    def lift_at_step(point) -> None:
        if lift["at"] is None and point.step >= lift_step:
            set_cpus(cluster.pids[2], 1.0)
            lift["at"], lift["step"] = time.time(), point.step

    try:
        with RelayClient(cluster.address) as client:
            row, points = run_job(client, code, args, strategy=BALANCED, workers=2, label=None,
                                  steps=args.lift_steps, on_point=lift_at_step)
    finally:
        set_cpus(cluster.pids[2], 0.5)
    first_move, resettle, changes = settle_steps(points, lift["at"] or float("inf"))
    return row, {"step": lift["step"], "first_move": first_move, "resettle": resettle, "changes": changes,
                 "settled_idle": idle_by_rank(points, after_step=changes[-1]) if changes else {},
                 "settled_rate": rate_after(points, changes[-1], args.batch) if changes else None,
                 "points": points}


def idle_gap(settled_idle: dict[int, float]) -> float | None:
    return round(abs(settled_idle[0] - settled_idle[1]), 3) if len(settled_idle) == 2 else None


def print_lifted(lifted: dict) -> None:
    """The lifted run's re-measurements and settling, as lines."""
    print(f"lifted run, at each re-measurement (step: shares of ranks 0, 1 / their measured samples/s); "
          f"the slow worker was lifted to 1 cpu when step {lifted['step']} was seen:")
    print("  " + "; ".join(f"{step}: {split[0]}+{split[1]} / {speeds[0]}, {speeds[1]}"
                           for step, split, speeds in remeasures(lifted["points"])))
    rate = lifted["settled_rate"]
    print(f"slow worker lifted to 1 cpu; shares changed at steps {lifted['changes']}; first {lifted['first_move']} "
          f"and last {lifted['resettle']} steps after (goal <= 2K = {2 * EVERY}); after the last change, idle in "
          f"the all-reduce {idle_text(lifted['settled_idle'])} (the gap between the ranks: the split's imbalance), "
          + (f"{rate:.0f} samples/s" if rate else "no throughput (no re-split after the lift)"))


def main_lifted(cluster, code: Path, args, versions: dict) -> None:
    """``--only lifted``: the lifted run ``--repeat`` times; RESULT holds each figure as a list."""
    runs = []
    for n in range(1, args.repeat + 1):
        print(f"lifted run {n} of {args.repeat}")
        runs.append(lifted_run(cluster, code, args, n)[1])
        print_lifted(runs[-1])
    result = {"resettle_steps": [r["resettle"] for r in runs], "first_move_steps": [r["first_move"] for r in runs],
              "settled_idle_gap": [idle_gap(r["settled_idle"]) for r in runs],
              "settled_samples_per_s": [round(r["settled_rate"]) if r["settled_rate"] else None for r in runs]}
    within = sum(1 for r in runs if r["resettle"] is not None and r["resettle"] <= 2 * EVERY)
    print(f"resettle_steps within 2K = {2 * EVERY}: {within} of {len(runs)}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(result_line(result, versions))


def main(argv=None) -> None:
    args = parse_args(argv)
    from torchrelay.client.cluster import AgentOptions, start_cluster, stop_cluster
    from torchrelay.client.sdk import RelayClient

    versions = package_versions(("torch",))
    print(header_line(versions))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.model}, global batch {args.batch}; "
          f"K={EVERY}; agents --cpus 1 and --cpus 0.5; solos {args.solos}")
    home = Path(tempfile.mkdtemp(prefix="relay-hetero-"))
    code = home / "code"
    code.mkdir()
    for name in MODEL_FILES[args.model]:
        shutil.copy(REPO / "examples" / name, code / Path(name).name)
    (code / "train.py").write_text(TRAIN.replace("{setup}", SETUP[args.model]))
    cluster = start_cluster(2, home=home / "relay", agent_options=[
        AgentOptions(cpus=1, labels={"speed": "fast"}), AgentOptions(cpus=0.5, labels={"speed": "slow"})])
    try:
        slow_dir = agent_cpu_dir(cluster.pids[2])
        quota = int((slow_dir / "cpu.cfs_quota_us").read_text()) / int((slow_dir / "cpu.cfs_period_us").read_text())
        assert quota == 0.5, f"no 0.5 cpu quota in {slow_dir} ({quota} cpu)"
        if args.only == "lifted":
            main_lifted(cluster, code, args, versions)
            return
        rows = run_solos(cluster.address, code, args)
        balanced_points = []
        with RelayClient(cluster.address) as client:
            for name in ("balanced ddp", "plain ddp", "balanced ddp 2"):
                strategy = {"kind": "ddp"} if name.startswith("plain") else BALANCED
                rows[name], points = run_job(client, code, args, strategy=strategy, workers=2, label=None,
                                             steps=args.steps)
                if name.startswith("balanced"):
                    balanced_points.append(points)
        rows.update({f"{name} 2": row for name, row in run_solos(cluster.address, code, args).items()})
        with RelayClient(cluster.address) as client:
            rows["balanced local_sgd"], _ = run_job(client, code, args, strategy=BALANCED_LOCAL_SGD, workers=2,
                                                    label=None, steps=args.steps)
        shares = [sorted({p.values.get("share") for p in points if p.rank == 0 and p.step > 40})
                  for points in balanced_points]
        rows["balanced, lifted"], lifted = lifted_run(cluster, code, args)
        equal = equal_pair(cluster, code, args)
    finally:
        stop_cluster(cluster.home)
        shutil.rmtree(home, ignore_errors=True)
    print(f"{'run':<20} {'samples/s':>10} {'time to loss (step)':>19}   idle in the all-reduce, by rank")
    for name, row in rows.items():
        ttl = (f"{row['time_to_loss_s']:.2f} s ({row['reached_step']})" if row["time_to_loss_s"] is not None
               else "not reached")
        print(f"{name:<20} {row['samples_per_s']:>10.0f} {ttl:>19}   {idle_text(row['idle'])}")
    solo_sums = [rows[f"solo fast{n}"]["samples_per_s"] + rows[f"solo slow{n}"]["samples_per_s"] for n in ("", " 2")]
    balanced_rates = [rows[name]["samples_per_s"] for name in ("balanced ddp", "balanced ddp 2")]
    solo_sum, balanced_rate = mean(solo_sums), mean(balanced_rates)
    plain_rate = rows["plain ddp"]["samples_per_s"]
    ttls = [rows[name]["time_to_loss_s"] for name in ("balanced ddp", "balanced ddp 2")]
    ttl_b = mean(ttls) if all(ttls) else None
    ttl_p = rows["plain ddp"]["time_to_loss_s"]
    local_sgd = rows["balanced local_sgd"]
    result = {"vs_sum_solo": round(balanced_rate / solo_sum, 3), "vs_equal_split": round(balanced_rate / plain_rate, 3),
              "time_to_loss_ratio": round(ttl_b / ttl_p, 3) if ttl_b and ttl_p else None,
              "resettle_steps": lifted["resettle"], "first_move_steps": lifted["first_move"],
              "settled_idle_gap": idle_gap(lifted["settled_idle"]),
              "settled_samples_per_s": round(lifted["settled_rate"]) if lifted["settled_rate"] else None,
              "equal_pair_vs_sum_solo": round(equal["ratio"], 3),
              "local_sgd_vs_sum_solo": round(local_sgd["samples_per_s"] / solo_sums[1], 3),
              "local_sgd_time_to_loss_ratio": round(local_sgd["time_to_loss_s"] / ttl_p, 3)
              if local_sgd["time_to_loss_s"] and ttl_p else None}
    print(f"solo fast + solo slow: {solo_sums[0]:.0f} before, {solo_sums[1]:.0f} after; "
          f"balanced: {balanced_rates[0]:.0f} and {balanced_rates[1]:.0f}")
    for n, (points, rate) in enumerate(zip(balanced_points, balanced_rates), 1):
        budget = step_budget(points, args.batch, rate, solo_sum)
        if budget:
            step_ms = args.batch / rate * 1000
            print(f"balanced run {n}'s step, {step_ms:.0f} ms: " + "; ".join(
                f"{name} {ms:.0f} ms ({ms / step_ms:.0%})" for name, ms in budget.items()))
    print(f"balanced / (solo fast + solo slow) = {result['vs_sum_solo']}  (goal >= 0.9; the means of two runs each)")
    print(f"balanced / plain ddp = {result['vs_equal_split']}  (goal >= 1.3, ceiling 1.5)")
    print(f"time to loss {args.target_loss}: balanced / plain = {result['time_to_loss_ratio']}  (goal <= 0.8)")
    print(f"rank 0's shares in the balanced runs after step 40: {shares[0]} and {shares[1]}")
    print(f"balanced local_sgd (parameters averaged every {LOCAL_SGD_EVERY} steps): "
          f"/ (solo fast + solo slow, the second solos) = {result['local_sgd_vs_sum_solo']}, "
          f"time to loss / plain ddp's = {result['local_sgd_time_to_loss_ratio']}")
    print_lifted(lifted)
    print(f"equal pair (both agents at 0.75 cpu): plain ddp {equal['pair']:.0f} samples/s against solo sums "
          f"{equal['solo_sums'][0]:.0f} before and {equal['solo_sums'][1]:.0f} after: {equal['ratio']:.3f} "
          f"(idle {idle_text(equal['idle'])}); "
          f"the balanced pair reaches {result['vs_sum_solo'] / equal['ratio']:.3f} of that")
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
