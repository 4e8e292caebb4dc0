"""How steady this machine's cores are: what a synchronous pair loses to them, with no framework.

One fixed training step (the char LM of examples/charlm, 32 windows of 64 characters, forward,
backward and an Adam step, one thread) is timed step by step: first in one process alone on the
first core this process may use, then in two processes at once, one on each of the first two
(cores 0 and 1 on an unrestricted machine). Nothing of torchrelay runs: no server, no agents, no
collectives. The figures:

- each process's median step and the fraction of its steps in a *slow phase* (more than 1.25 ×
  the alone run's median);
- ``sync_vs_independent``: the two processes' timelines cut into bins of ``--bin`` seconds; in
  each bin, the samples/s of two synchronous workers on an even split (each bin's step waits
  for the slower core: ``2 / max(a, b)``) over the two running independently (``1/a + 1/b``).
  That is what two equal workers in synchronous data parallel lose to the cores' phases alone,
  before any all-reduce: a ceiling for ``bench/hetero.py``'s equal pair and vs_sum_solo here;
- the correlation of the two cores' bin means (1: they slow down together, as a machine-wide
  phase would; near 0: each core on its own).

    .venv/bin/python bench/core_phases.py [--seconds 30] [--bin 0.25]

Ends with ``RESULT {"alone_median_ms", "pair_median_ms", "slow_fraction_alone",
"slow_fraction_pair", "sync_vs_independent", "core_correlation"}``. Needs 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import header_line, package_versions, result_line  # noqa: E402
from _ranks import run_owned  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SLOW = 1.25  # a step this many times the alone median is in a slow phase

# One process: pinned to its core, the same step over and over, (wall time, seconds) per step.
STEPPER = '''
import json, os, sys, time
core, seconds, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
os.sched_setaffinity(0, {core})
sys.path.insert(0, sys.argv[4])
import torch
torch.set_num_threads(1)
from data import CharCorpus, stdlib_text, text_windows
from model import CharLM, CharLMConfig, lm_loss
corpus = CharCorpus.from_text(stdlib_text())
windows, _ = text_windows(corpus.train, 64)
torch.manual_seed(0)
model = CharLM(CharLMConfig(vocab_size=corpus.vocab_size, context=64))
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
x, y = windows[:32, :-1], windows[:32, 1:]
for _ in range(5):  # warm-up, not recorded
    optimizer.zero_grad(); lm_loss(model(x), y).backward(); optimizer.step()
steps, end = [], time.time() + seconds
while time.time() < end:
    began = time.perf_counter()
    optimizer.zero_grad(); lm_loss(model(x), y).backward(); optimizer.step()
    steps.append((time.time(), time.perf_counter() - began))
with open(out, "w") as f:
    json.dump(steps, f)
'''


def run_steppers(cores: list[int], seconds: float, home: Path) -> list[list[tuple[float, float]]]:
    """One stepper per core, all at once (``_ranks.run_owned``: each in its own session, all ended
    by the time it returns); their (wall time, step seconds) lists."""
    outs = [home / f"core-{core}-{index}.json" for index, core in enumerate(cores)]
    charlm = str(REPO / "examples" / "charlm")
    run_owned([[sys.executable, "-c", STEPPER, str(core), str(seconds), str(out), charlm]
               for core, out in zip(cores, outs)], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=seconds + 120)
    return [[tuple(step) for step in json.loads(out.read_text())] for out in outs]


def bin_means(steps: list[tuple[float, float]], start: float, width: float) -> dict[int, float]:
    """Mean step seconds in each bin of ``width`` seconds from ``start``."""
    bins: dict[int, list[float]] = {}
    for wall, seconds in steps:
        bins.setdefault(int((wall - start) // width), []).append(seconds)
    return {k: statistics.fmean(v) for k, v in bins.items()}


def pair_figures(a: list[tuple[float, float]], b: list[tuple[float, float]], width: float) -> tuple[float, float]:
    """(sync_vs_independent, the correlation of the two cores' bin means) over the bins both have."""
    start = min(a[0][0], b[0][0])
    mean_a, mean_b = bin_means(a, start, width), bin_means(b, start, width)
    shared = sorted(set(mean_a) & set(mean_b))
    synchronous = sum(2 / max(mean_a[k], mean_b[k]) for k in shared)
    independent = sum(1 / mean_a[k] + 1 / mean_b[k] for k in shared)
    correlation = statistics.correlation([mean_a[k] for k in shared], [mean_b[k] for k in shared])
    return synchronous / independent, correlation


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of each run")
    parser.add_argument("--bin", type=float, default=0.25, help="seconds of a bin for the pair's figures")
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        sys.exit(f"core_phases needs 2 cores; this process may use {len(cores)}")
    versions = package_versions(("torch",))
    print(header_line(versions))
    print(f"load average {os.getloadavg()[0]:.1f}; the char LM's step at 32 windows, one thread a process, "
          f"{args.seconds:.0f} s alone on core {cores[0]}, then {args.seconds:.0f} s on cores {cores[0]} and "
          f"{cores[1]} at once")
    with tempfile.TemporaryDirectory(prefix="relay-core-phases-") as tmp:
        (alone,) = run_steppers(cores[:1], args.seconds, Path(tmp))
        pair = run_steppers(cores, args.seconds, Path(tmp))
    alone_median = statistics.median(s for _, s in alone)

    def slow_fraction(steps) -> float:
        return sum(1 for _, s in steps if s > SLOW * alone_median) / len(steps)

    sync, correlation = pair_figures(pair[0], pair[1], args.bin)
    both = pair[0] + pair[1]
    print(f"{'run':<16} {'steps':>6} {'median':>9} {'p90':>9} {'slow phase':>11}")
    runs = ((f"alone, core {cores[0]}", alone), (f"pair, core {cores[0]}", pair[0]),
            (f"pair, core {cores[1]}", pair[1]))
    for name, steps in runs:
        seconds = sorted(s for _, s in steps)
        print(f"{name:<16} {len(steps):>6} {1000 * statistics.median(seconds):>7.1f}ms "
              f"{1000 * seconds[9 * len(seconds) // 10]:>7.1f}ms {slow_fraction(steps):>10.0%}")
    print(f"two synchronous workers / two independent ones, {args.bin} s bins: {sync:.3f}; "
          f"the cores' bin means correlate {correlation:.2f}")
    result = {"alone_median_ms": round(1000 * alone_median, 1),
              "pair_median_ms": round(1000 * statistics.median(s for _, s in both), 1),
              "slow_fraction_alone": round(slow_fraction(alone), 3),
              "slow_fraction_pair": round(slow_fraction(both), 3),
              "sync_vs_independent": round(sync, 3), "core_correlation": round(correlation, 2)}
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
