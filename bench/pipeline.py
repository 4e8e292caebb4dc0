"""Pipeline parallelism benchmark (issue 7): ours and the baselines side by side in one run.

(a) speedup_2x8: a balanced MLP, 2 stages × 8 micro-batches, one thread per stage, against
    the same model in one process with one thread on the same 8 micro-batches with gradient
    accumulation (docs/design.md, micro-batches on CPU: they are not free, so the baseline
    micro-batches too).
    Rows for our lean 1F1B and GPipe and for torch.distributed.pipelining's 1F1B and GPipe.
(b) auto_vs_equal, auto_vs_best: the char transformer with a large embedding and head
    (``LM``: vocabulary 22528, width 128, 10 layers, 4 × 32 tokens per micro-batch; 12
    blocks). The issue's scenario is a model whose embedding and head are heavy enough that
    cutting it into equal layer counts is clearly wrong: here the embedding holds 2.9 M
    parameters (1.4× all 10 layers) and costs about one layer's time (its gradient is a
    dense 22528 × 128 table), and the head (a 128 × 22528 projection and its softmax) costs
    about 10 layers' time, ≈ 47% of the model. The equal-layer split (embedding + 5 layers |
    5 layers + head) then has its slowest stage ≈ 1.35× the best cut's. How much any cut can
    gain is bounded: with 2 stages × 8 micro-batches a step is ≈ 7 × the slowest stage +
    both stages, so no cut beats the equal split by more than ≈ 1.39× whatever the head's
    size (the bound is reached when the head is half the model; a heavier head is then the
    slowest stage alone for every cut); with the embedding costing a layer and 10 layers,
    ≈ 1.35. The vocabulary was 16384 until session 3; once glibc stopped re-faulting the
    head's and embedding's 8 MiB gradients every step (``torchrelay/train/allocator.py``)
    the head was ≈ 40% of that model, and even its best cut predicted only ≈ 1.24× and
    measured 1.28× the equal split, so the head was made ≈ half the model again. Step
    time of the profiled automatic plan against the equal-layer split and against the
    fastest of all 11 contiguous 2-stage splits, each measured (an exhaustive search).
    ``auto_cut`` / ``best_cut_replay`` name the plan's cut and the fastest cut by replay;
    ``auto_cut_vs_best_replay`` compares the two cuts' own configurations, which says
    whether the plan chose well without the run-to-run noise between two separately built
    pipelines of the same plan.
(c) prediction_error: the plan's predicted compute time per micro-batch of each stage over
    the time the stage really computed per micro-batch in the pipeline (largest |ratio - 1|).
(d) plan_s_100x8: planning time for 100 blocks on 8 stages.

All configurations run in one pair of processes, interleaved round by round (in an order
shuffled every round), so machine noise hits them alike; each turn's first step is not
recorded (it runs on caches the other
configurations filled). A step is timed from the first rank's start to the last rank's end
on the host's monotonic clock, with no barrier inside the span. Since the machine is shared, each figure also comes from CPU time:
``*_replay`` replays both ranks' per-action CPU traces of each step (our runtime's
``last_trace``, ``runtime.replay_step``), which gives the step on two idle cores with free
messages, i.e. what the schedule and our per-micro-batch overhead cost without the other
processes on the machine; ``*_cpu_estimate`` is the older, coarser formula from CPU time
per step. Usage: ``OMP_NUM_THREADS=1 python bench/pipeline.py [--quick]``.
Last line: ``RESULT {json}``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _env import TRAINING_PACKAGES, header_line, package_versions, result_line  # noqa: E402
from _ranks import free_port, run_owned  # noqa: E402

MLP = dict(width=512, depth=8, microbatch=32, microbatches=8)
LM = dict(vocab=22528, dim=128, depth=10, heads=4, context=32, microbatch=4, microbatches=8)


def _launch(args: argparse.Namespace, out_dir: str) -> dict:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run_owned([[sys.executable, __file__, "--worker", str(rank), "--port", str(port), "--out", out_dir,
                "--rounds", str(args.rounds), "--steps", str(args.steps), "--parts", args.parts]
               for rank in range(2)], env)
    return json.loads(Path(out_dir, "result.json").read_text())


# ---------------------------------------------------------------- worker


def _worker(rank: int, port: int, out_dir: str, rounds: int, steps: int, parts: str) -> None:

    import torch
    import torch.distributed as dist

    from torchrelay.spec import PipelineStrategy
    from torchrelay.train.pipeline import build_on_meta, materialize_module, prepare
    from torchrelay.train.pipeline.models import balanced_mlp, char_transformer, lm_loss, mse_loss
    from torchrelay.train.pipeline.runtime import replay_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)

    # ---- data
    m_mlp = MLP["microbatches"]
    mlp_x = torch.randn(MLP["microbatch"] * m_mlp, MLP["width"])
    mlp_y = torch.randn_like(mlp_x)
    m_lm = LM["microbatches"]
    tokens = torch.randint(0, LM["vocab"], (LM["microbatch"] * m_lm, LM["context"] + 1))
    lm_x, lm_y = tokens[:, :-1], tokens[:, 1:]

    def mlp_meta():
        return build_on_meta(lambda: balanced_mlp(MLP["width"], MLP["depth"]))

    def lm_meta():
        return build_on_meta(lambda: char_transformer(LM["vocab"], LM["dim"], LM["depth"],
                                                      LM["heads"], LM["context"]))

    # ---- (a) the single-process baseline: same micro-batches, gradient accumulation
    baseline = torch.nn.Sequential(*[materialize_module(b, "cpu", i)
                                     for i, b in enumerate(mlp_meta())])

    def baseline_step():
        for x, y in zip(torch.tensor_split(mlp_x, m_mlp), torch.tensor_split(mlp_y, m_mlp)):
            (mse_loss(baseline(x), y) / m_mlp).backward()
        baseline.zero_grad(set_to_none=True)

    def pipeline(meta, loss_fn, m, schedule, runtime, plan, sample=None, sample_target=None,
                 transport="auto"):
        strategy = PipelineStrategy(kind="pipeline", microbatches=m, schedule=schedule)
        return prepare(meta, loss_fn, strategy, plan=plan, runtime=runtime, sample=sample,
                       sample_target=sample_target, transport=transport)

    half = MLP["depth"] // 2
    mlp_pipes = {}
    if "a" in parts:
        mlp_pipes = {
            f"{rt} {sched}": pipeline(mlp_meta(), mse_loss, m_mlp, sched, rt, [0, half])
            for rt in ("lean", "torch") for sched in ("1f1b", "gpipe")
        }
        # ours over gloo send/recv instead of shared memory: what the transport is worth
        mlp_pipes["lean-gloo 1f1b"] = pipeline(mlp_meta(), mse_loss, m_mlp, "1f1b", "lean",
                                               [0, half], transport="gloo")
    n_lm = LM["depth"] + 2
    auto, cuts, profile_and_plan_s = None, {}, 0.0
    if "b" in parts:
        started = time.perf_counter()
        auto = pipeline(lm_meta(), lm_loss, m_lm, "1f1b", "lean", None,
                        sample=lm_x[:LM["microbatch"]], sample_target=lm_y[:LM["microbatch"]])
        profile_and_plan_s = time.perf_counter() - started
        cuts = {c: pipeline(lm_meta(), lm_loss, m_lm, "1f1b", "lean", [0, c])
                for c in range(1, n_lm)}

    cpu: dict[str, list[float]] = {}
    traces: dict[str, list] = {}  # our runtime's per-step CPU trace (runtime.replay_step)

    def run_queue_s() -> float:
        """Seconds this thread has waited for a CPU while runnable (Linux schedstat)."""
        try:
            with open("/proc/thread-self/schedstat") as f:
                return int(f.read().split()[1]) * 1e-9
        except (OSError, IndexError, ValueError):
            return float("nan")

    def across_ranks(spans):
        """Each step from the first rank's start to the last rank's end. perf_counter is
        CLOCK_MONOTONIC, one clock for every process of the host, so no barrier (≈ 1 ms of
        gloo round trips) has to sit inside the timed span. Collective."""
        everyone = [None, None]
        dist.all_gather_object(everyone, spans)
        return [max(e0, e1) - min(s0, s1)
                for (s0, e0), (s1, e1) in zip(everyone[0], everyone[1])]

    def run(pipe, x, y, n, name=None):
        """``n`` recorded steps of ``pipe``, after one that is not: configurations take turns,
        and the first step after a switch runs on caches the others filled (≈ 10% slower
        here), which a job running one configuration never sees."""
        spans, busy = [], []
        for step_index in range(n + 1):
            dist.barrier()
            q0 = run_queue_s()
            t0, c0, th0 = time.perf_counter(), time.process_time(), time.thread_time()
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            pipe.module.zero_grad(set_to_none=True)
            spans.append((t0, time.perf_counter()))
            c1, th1 = time.process_time(), time.thread_time()
            q1 = run_queue_s()
            dist.barrier()  # the next step starts when both stages are done
            if step_index == 0:
                spans.pop()
                continue
            busy.append(getattr(pipe.runner, "last_busy_s", float("nan")))
            if name:
                if getattr(pipe.runner, "last_trace", None):
                    traces.setdefault(name, []).append(pipe.runner.last_trace)
                cpu.setdefault(name, []).append(c1 - c0)
                cpu.setdefault(f"{name} main thread", []).append(th1 - th0)
                cpu.setdefault(f"{name} compute", []).append(busy[-1])
                cpu.setdefault(f"{name} run queue", []).append(q1 - q0)
        return across_ranks(spans), busy

    # this rank's half of the MLP alone (the other rank waits): compute without a neighbour
    own_half = torch.nn.Sequential(*[materialize_module(b, "cpu", i) for i, b in
                                     enumerate(mlp_meta()[:MLP["depth"] // 2])])

    def isolated_half(n):
        for who in (0, 1):
            for _ in range(n):
                dist.barrier()
                if rank == who:
                    c0 = time.thread_time()
                    for x in torch.tensor_split(mlp_x, m_mlp):
                        out = own_half(x.requires_grad_())
                        out.backward(torch.ones_like(out))
                    own_half.zero_grad(set_to_none=True)
                    cpu.setdefault("isolated half", []).append(time.thread_time() - c0)

    def run_baseline(n):
        spans = []
        for step_index in range(n + 1):  # the first step is not recorded, as in run()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if rank == 0:
                baseline_step()
            t1, c1 = time.perf_counter(), time.process_time()
            dist.barrier()  # rank 1 waits in the barrier, off the CPU
            if step_index:
                spans.append((t0, t1))
                cpu.setdefault("baseline", []).append(c1 - c0)
        return across_ranks(spans)

    # warm up every configuration (first steps learn shapes)
    run_baseline(2)
    for pipe in [*mlp_pipes.values(), *([auto] if auto else []), *cuts.values()]:
        run(pipe, *((mlp_x, mlp_y) if pipe in mlp_pipes.values() else (lm_x, lm_y)), 2)

    samples: dict[str, list[float]] = {"baseline": []}
    busy_auto: list[float] = []
    # One turn per configuration and round, in an order shuffled every round (the same on
    # both ranks): a configuration that always followed the same other one would carry that
    # one's effect on the caches (the automatic plan, always first after the MLP, ran 2–3%
    # slower than the same cut measured amid the other cuts).
    lm_steps = max(1, steps // 2)  # 12 configurations of a slower model

    def baseline_turn():
        samples["baseline"].extend(run_baseline(steps))

    def mlp_turn(name, pipe):
        samples.setdefault(name, []).extend(run(pipe, mlp_x, mlp_y, steps, name)[0])

    def auto_turn():
        t, b = run(auto, lm_x, lm_y, lm_steps, "lm auto")
        samples.setdefault("lm auto", []).extend(t)
        busy_auto.extend(b)

    def cut_turn(c, pipe):
        samples.setdefault(f"lm cut {c}", []).extend(
            run(pipe, lm_x, lm_y, lm_steps, f"lm cut {c}")[0])

    turns = [baseline_turn]
    if "a" in parts:
        turns.append(lambda: isolated_half(steps))
        turns += [functools.partial(mlp_turn, name, pipe) for name, pipe in mlp_pipes.items()]
    if "b" in parts:
        turns.append(auto_turn)
        turns += [functools.partial(cut_turn, c, pipe) for c, pipe in cuts.items()]
    for round_index in range(rounds):
        for turn in random.Random(round_index).sample(turns, len(turns)):
            turn()

    medians = {k: statistics.median(v) for k, v in samples.items()}
    busy_all = [None, None]
    dist.all_gather_object(busy_all, statistics.median(busy_auto) if busy_auto else None)
    cpu_all = [None, None]  # CPU seconds per step on each rank (gloo's threads included)
    dist.all_gather_object(cpu_all, {k: statistics.median(v) for k, v in cpu.items()})
    traces_all = [None, None]
    dist.all_gather_object(traces_all, traces)
    # each configuration's steps replayed from both stages' CPU traces: the step on idle cores
    replayed = {name: statistics.median(replay_step([t0, t1]) for t0, t1 in
                                        zip(traces_all[0][name], traces_all[1][name]))
                for name in traces_all[0]}
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps({
            "medians": medians, "auto_plan": auto.plan.to_dict() if auto else None,
            "auto_plan_text": auto.plan.describe() if auto else "",
            "auto_busy_per_stage_s": busy_all, "replayed_s": replayed, "cpu_per_rank_s": cpu_all, "profile_and_plan_s": profile_and_plan_s,
            "num_lm_blocks": n_lm,
        }))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- report


def _plan_time_100x8() -> float:
    from torchrelay.train.pipeline.partition import BlockCost, DeviceSpec, Link, plan_stages
    blocks = [BlockCost(time_s=1e-3 * (1 + (i * 7919) % 13), out_bytes=4096 * (1 + i % 5),
                        param_bytes=10**6 * (1 + i % 3), stash_bytes=10**5) for i in range(100)]
    devices = [DeviceSpec(f"d{k}", speed=1.0 + 0.5 * (k % 2), mem_cap_bytes=10**8)
               for k in range(8)]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        plan_stages(blocks, devices, Link(2.6e9, 5e-5), microbatches=16)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=int, default=None)
    parser.add_argument("--port", type=int)
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps")
    parser.add_argument("--parts", default="ab", help="which of (a) and (b) to run: a, b, ab")
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.port, args.out, args.rounds, args.steps, args.parts)
        return
    if args.quick:
        args.rounds, args.steps = 2, 2
    versions = package_versions(TRAINING_PACKAGES)
    print(header_line(versions), flush=True)
    with tempfile.TemporaryDirectory() as out_dir:
        res = _launch(args, out_dir)
    med = res["medians"]
    base = med["baseline"]
    result = {}
    if "a" in args.parts:
        print(f"(a) balanced MLP {MLP['depth']}x{MLP['width']}, 2 stages x {MLP['microbatches']} "
              f"micro-batches of {MLP['microbatch']}, 1 thread per process")
        print(f"    {'one process, grad accumulation':34s} {base * 1e3:8.2f} ms/step   1.00x")
        for name in ("lean 1f1b", "lean gpipe", "lean-gloo 1f1b", "torch 1f1b", "torch gpipe"):
            runtime_label = {"lean": "ours", "lean-gloo": "ours over gloo",
                             "torch": "torch.distributed.pipelining"}[name.split()[0]]
            label = f"{runtime_label} {name.split()[1]}"
            print(f"    {label:34s} {med[name] * 1e3:8.2f} ms/step   {base / med[name]:.2f}x")
        # The machine is shared: CPU time per step is what contention distorts least. Overhead is
        # the pipeline's CPU time over the baseline's; on two idle cores the 1F1B step would take
        # (M + S - 1) / M of the busier stage's CPU time.
        cpu0, cpu1 = res["cpu_per_rank_s"]
        m_a = MLP["microbatches"]
        print("    CPU time per step (rank 0 + rank 1), and the speedup it implies on idle cores:")
        estimates = {}
        for name in ("lean 1f1b", "lean gpipe", "lean-gloo 1f1b", "torch 1f1b", "torch gpipe"):
            total = cpu0[name] + cpu1[name]
            estimates[name] = cpu0["baseline"] / (max(cpu0[name], cpu1[name]) * (m_a + 1) / m_a)
            print(f"    {name:34s} {cpu0[name] * 1e3:7.2f} + {cpu1[name] * 1e3:7.2f} ms "
                  f"(baseline {cpu0['baseline'] * 1e3:7.2f}; overhead {total / cpu0['baseline'] - 1:+.1%})"
                  f"  -> {estimates[name]:.2f}x")
        rep_a = res["replayed_s"]
        print("    each step replayed from both ranks' CPU traces (idle cores, free messages; "
              f"ideal {2 * m_a / (m_a + 1):.2f}x):")
        for name in ("lean 1f1b", "lean gpipe", "lean-gloo 1f1b"):
            print(f"    {name:34s} {rep_a[name] * 1e3:7.2f} ms  -> "
                  f"{cpu0['baseline'] / rep_a[name]:.2f}x")
        print("    where a step's time goes in ours 1F1B, per rank (CPU ms per step):")
        for r, c in enumerate(res["cpu_per_rank_s"]):
            other_main = c["lean 1f1b main thread"] - c["lean 1f1b compute"]
            gloo = c["lean 1f1b"] - c["lean 1f1b main thread"]
            print(f"    rank {r}: compute {c['lean 1f1b compute'] * 1e3:6.2f} (its half alone "
                  f"{c['isolated half'] * 1e3:6.2f}), rest of main thread {other_main * 1e3:5.2f}, "
                  f"other threads (gloo) {gloo * 1e3:5.2f}; waiting for a core (other "
                  f"processes) {c['lean 1f1b run queue'] * 1e3:5.2f}; wall {med['lean 1f1b'] * 1e3:6.2f}")
        result.update({
            "speedup_2x8": round(base / med["lean 1f1b"], 3),
            "speedup_2x8_gpipe": round(base / med["lean gpipe"], 3),
            "speedup_2x8_over_gloo": round(base / med["lean-gloo 1f1b"], 3),
            "torch_1f1b_speedup_2x8": round(base / med["torch 1f1b"], 3),
            "torch_gpipe_speedup_2x8": round(base / med["torch gpipe"], 3),
            "speedup_2x8_cpu_estimate": round(estimates["lean 1f1b"], 3),
            "speedup_2x8_replay": round(cpu0["baseline"] / rep_a["lean 1f1b"], 3),
            # ms per step each rank waited for a core (other processes): what the wall-clock
            # figures measure besides this pipeline
            "run_queue_ms_per_rank": [round(c["lean 1f1b run queue"] * 1e3, 2)
                                      for c in res["cpu_per_rank_s"]],
            "speedup_2x8_gpipe_replay": round(cpu0["baseline"] / rep_a["lean gpipe"], 3),
            "torch_1f1b_cpu_estimate": round(estimates["torch 1f1b"], 3),
        })
    if "b" in args.parts:
        plan = res["auto_plan"]
        n = res["num_lm_blocks"]
        equal_cut = (n + 1) // 2
        auto_cut = plan["stages"][1]["blocks"][0]
        cut_times = {c: med[f"lm cut {c}"] for c in range(1, n)}
        best_cut = min(cut_times, key=cut_times.get)
        print(f"(b) transformer vocab {LM['vocab']} dim {LM['dim']} depth {LM['depth']}: {n} blocks, "
              f"2 stages x {LM['microbatches']} micro-batches (lean 1F1B)")
        for c, t in cut_times.items():
            tags = [tag for tag, cc in (("equal", equal_cut), ("auto", auto_cut), ("best", best_cut))
                    if cc == c]
            print(f"    cut before block {c}: {t * 1e3:8.2f} ms/step  {' '.join(tags)}")
        print(f"    automatic plan (own run)  : {med['lm auto'] * 1e3:8.2f} ms/step "
              f"(profile + plan took {res['profile_and_plan_s']:.2f} s)")
        print("    " + res["auto_plan_text"].replace("\n", "\n    "))
        auto_vs_equal = cut_times[equal_cut] / med["lm auto"]
        auto_vs_best = med["lm auto"] / cut_times[best_cut]
        # Less distorted by a loaded machine: the step a 2-stage 1F1B takes on two idle cores
        # from each rank's CPU time per step (the busier stage's, plus one micro-batch of the
        # other to fill and drain the pipeline).
        cpu0, cpu1 = res["cpu_per_rank_s"]

        def cpu_step(name):
            a, b = cpu0[name], cpu1[name]
            return max(a, b) + min(a, b) / LM["microbatches"]

        cpu_cut = {c: cpu_step(f"lm cut {c}") for c in range(1, n)}
        cpu_auto = cpu_step("lm auto")
        cpu_best = min(cpu_cut, key=cpu_cut.get)
        print("    from CPU time per step (idle-core estimate): "
              + ", ".join(f"cut {c} {t * 1e3:.0f}" for c, t in cpu_cut.items())
              + f", auto {cpu_auto * 1e3:.0f} ms; best cut {cpu_best}")
        rep_b = res["replayed_s"]
        rep_cut = {c: rep_b[f"lm cut {c}"] for c in range(1, n)}
        rep_best = min(rep_cut, key=rep_cut.get)
        print("    replayed from CPU traces (idle cores): "
              + ", ".join(f"cut {c} {t * 1e3:.0f}" for c, t in rep_cut.items())
              + f", auto {rep_b['lm auto'] * 1e3:.0f} ms; best cut {rep_best}")
        result.update({
            "auto_vs_equal_replay": round(rep_cut[equal_cut] / rep_b["lm auto"], 3),
            "auto_vs_best_replay": round(rep_b["lm auto"] / rep_cut[rep_best], 3),
            "auto_vs_equal_cpu_estimate": round(cpu_cut[equal_cut] / cpu_auto, 3),
            "auto_vs_best_cpu_estimate": round(cpu_auto / cpu_cut[cpu_best], 3),
            # the cut the plan chose, the fastest cut by replay, and the chosen cut's own
            # configuration replayed against that best (same plan as "auto", other process
            # state: their difference is the run's noise)
            "auto_cut": auto_cut, "best_cut_replay": rep_best,
            "auto_cut_vs_best_replay": round(rep_cut[auto_cut] / rep_cut[rep_best], 3),
        })
        m = LM["microbatches"]
        errors = []
        print("(c) predicted vs measured compute per micro-batch (automatic plan)")
        for stage, busy in zip(plan["stages"], res["auto_busy_per_stage_s"]):
            measured = busy / m
            ratio = stage["compute_s"] / measured
            errors.append(abs(ratio - 1))
            print(f"    stage {stage['stage']}: predicted {stage['compute_s'] * 1e3:7.2f} ms, "
                  f"measured {measured * 1e3:7.2f} ms, ratio {ratio:.2f}")
        step_ratio = plan["predicted_step_s"] / med["lm auto"]
        print(f"    step: predicted {plan['predicted_step_s'] * 1e3:.2f} ms, measured "
              f"{med['lm auto'] * 1e3:.2f} ms, ratio {step_ratio:.2f}")
        result.update({
            "auto_vs_equal": round(auto_vs_equal, 3),
            "auto_vs_best": round(auto_vs_best, 3),
            "prediction_error": round(max(errors), 3),
            "step_prediction_ratio": round(step_ratio, 3),
        })
    plan_s = _plan_time_100x8()
    print(f"(d) planning 100 blocks onto 8 stages: {plan_s * 1e3:.2f} ms")
    result["plan_s_100x8"] = round(plan_s, 4)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
