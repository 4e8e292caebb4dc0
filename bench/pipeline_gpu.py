"""Pipeline on a CPU and a GPU together (issue 7's heterogeneous devices), on a GPU machine.

Rank 0 on the CPU (one thread), rank 1 on GPU 0, over gloo: the char transformer of
bench/pipeline.py part (b) (vocabulary 16384, width 128, 10 layers; 12 blocks), 2 stages ×
8 micro-batches, lean 1F1B. Side by side in one run, step time (median):
- the whole model in one process on the CPU, and in one process on the GPU (gradient
  accumulation over the same 8 micro-batches);
- the pipeline cut into equal layer counts, and cut by the automatic plan, which profiles
  every block on each rank's own device.
Also tries two ranks of NCCL on one GPU (torch's runtime), which NCCL may refuse.
Usage: ``python bench/pipeline_gpu.py``. Last line: ``RESULT {json}``.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _env import TRAINING_PACKAGES, header_line, package_versions, result_line  # noqa: E402

LM = dict(vocab=16384, dim=128, depth=10, heads=4, context=32, microbatch=4, microbatches=8)
STEPS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario: str, out_dir: str, timeout: float) -> str | None:
    """Run both ranks; returns None, or why they failed (exit code or timeout)."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, scenario, str(rank), str(port), out_dir],
                              env=env, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for rank in range(2)]
    failure = None
    try:
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                failure = f"rank {rank} exited {proc.returncode}: " + \
                    out.decode(errors="replace")[-1500:]
    except subprocess.TimeoutExpired:
        failure = f"timed out after {timeout:.0f} s"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return failure


def _worker(scenario: str, rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from torchrelay.spec import PipelineStrategy
    from torchrelay.train.pipeline import build_on_meta, materialize_module, prepare
    from torchrelay.train.pipeline.models import balanced_mlp, char_transformer, lm_loss, mse_loss

    torch.set_num_threads(1)
    if scenario == "nccl_same_gpu":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        pipe = prepare(build_on_meta(lambda: balanced_mlp(256, 4)), mse_loss,
                       PipelineStrategy(kind="pipeline", microbatches=4, schedule="1f1b"),
                       plan=[0, 2], runtime="torch", device="cuda:0")
        x = torch.randn(16, 256, device="cuda:0")
        pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        return

    device = torch.device("cpu" if rank == 0 else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    m = LM["microbatches"]
    tokens = torch.randint(0, LM["vocab"], (LM["microbatch"] * m, LM["context"] + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def meta():
        return build_on_meta(lambda: char_transformer(LM["vocab"], LM["dim"], LM["depth"],
                                                      LM["heads"], LM["context"]))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def alone(on: str) -> float:
        """The whole model in this process on ``on``, gradient accumulation."""
        model = torch.nn.Sequential(*[materialize_module(b, on, i) for i, b in enumerate(meta())])
        xs, ys = torch.tensor_split(x.to(on), m), torch.tensor_split(y.to(on), m)
        times = []
        for _ in range(STEPS + 2):
            start = time.perf_counter()
            for xm, ym in zip(xs, ys):
                (lm_loss(model(xm), ym) / m).backward()
            model.zero_grad(set_to_none=True)
            if on != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])

    strategy = PipelineStrategy(kind="pipeline", microbatches=m, schedule="1f1b")
    n = LM["depth"] + 2
    started = time.perf_counter()
    auto = prepare(meta(), lm_loss, strategy, runtime="lean", device=device,
                   sample=x[:LM["microbatch"]].to(device), sample_target=y[:LM["microbatch"]].to(device))
    plan_s = time.perf_counter() - started
    equal = prepare(meta(), lm_loss, strategy, runtime="lean", device=device, plan=[0, (n + 1) // 2])

    def pipelined(pipe) -> float:
        times = []
        for _ in range(STEPS + 2):
            dist.barrier()
            start = time.perf_counter()
            pipe.step(x.to(device) if pipe.is_first else None, y.to(device) if pipe.is_last else None)
            pipe.module.zero_grad(set_to_none=True)
            sync()
            spans = [None, None]
            dist.all_gather_object(spans, (start, time.perf_counter()))
            times.append(max(e for _, e in spans) - min(s for s, _ in spans))
        return statistics.median(times[2:])

    result = {"auto_s": pipelined(auto), "equal_s": pipelined(equal),
              "plan": auto.plan.to_dict(), "plan_text": auto.plan.describe(),
              "profile_and_plan_s": plan_s}
    dist.barrier()
    if rank == 0:
        result["cpu_alone_s"] = alone("cpu")
    dist.barrier()
    if rank == 1:
        result["gpu_alone_s"] = alone("cuda:0")
        result["gpu"] = torch.cuda.get_device_name(0)
    Path(out_dir, f"{scenario}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1:
        _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    versions = package_versions(TRAINING_PACKAGES)
    print(header_line(versions), flush=True)
    with tempfile.TemporaryDirectory() as out_dir:
        nccl_failure = _launch("nccl_same_gpu", out_dir, timeout=60)
        mixed_failure = _launch("mixed", out_dir, timeout=600)
        if mixed_failure:
            raise SystemExit(f"mixed pipeline failed: {mixed_failure}")
        r0 = json.loads(Path(out_dir, "mixed-0.json").read_text())
        r1 = json.loads(Path(out_dir, "mixed-1.json").read_text())
    print(f"CPU rank 0 + {r1['gpu']} rank 1, char transformer vocab {LM['vocab']} dim "
          f"{LM['dim']} depth {LM['depth']}, 2 stages x {LM['microbatches']} micro-batches")
    rows = [("one process on the CPU", r0["cpu_alone_s"]),
            ("pipeline, equal-layer split", r0["equal_s"]),
            ("pipeline, automatic plan", r0["auto_s"]),
            ("one process on the GPU", r1["gpu_alone_s"])]
    for label, seconds in rows:
        print(f"    {label:30s} {seconds * 1e3:9.2f} ms/step   {r0['cpu_alone_s'] / seconds:6.2f}x")
    print("    " + r0["plan_text"].replace("\n", "\n    "))
    print(f"    profile + plan took {r0['profile_and_plan_s']:.2f} s")
    if nccl_failure is None:
        print("two NCCL ranks on one GPU: ran")
    else:
        lines = nccl_failure.splitlines()
        # NCCL's own reason follows its "Last error:" line
        errors = [after for before, after in zip(lines, lines[1:]) if "Last error" in before] \
            or [line for line in lines if "rror" in line]
        print("two NCCL ranks on one GPU: refused: "
              + (errors[-1] if errors else nccl_failure.strip().splitlines()[-1]).strip())
    print(result_line({
        "auto_vs_equal_mixed": round(r0["equal_s"] / r0["auto_s"], 3),
        "auto_vs_cpu_alone": round(r0["cpu_alone_s"] / r0["auto_s"], 3),
        "auto_cut": r0["plan"]["stages"][1]["blocks"][0],
        "nccl_two_ranks_one_gpu": nccl_failure is None,
    }, versions))


if __name__ == "__main__":
    main()
