"""Pipelines on a GPU: skipped where torch sees no CUDA device (CI has none).

Run on a GPU machine with ``pytest tests/integration/test_pipeline_gpu.py -s``. Each test
starts real ranks (this file run as a script) on 127.0.0.1 and compares loss and gradients
with the unsplit model on the same micro-batches, as tests/integration/test_pipeline.py
does on CPU:
- ``gloo_gpu``: two ranks on GPU 0 over gloo (lean runtime, host-staged messages), GPipe and
  1F1B, an MLP with a fixed cut and the char transformer with a plan profiled on the GPU;
- ``mixed``: rank 0 on the CPU, rank 1 on GPU 0, one pipeline: the plan, from each rank's
  own block times, gives the GPU the heavy part (the head and most layers);
- ``nccl_single``: one rank, NCCL, torch's runtime (a one-stage pipeline);
- ``nccl``: two ranks on two GPUs, NCCL, torch.distributed.pipelining's schedules (needs 2).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]



def _run_workers(tmp_path: Path, world: int, scenario: str, timeout: float = 180) -> list[dict]:
    """This file's ranks, owned (tests/rank_scripts.py)."""
    from rank_scripts import run_ranks
    return run_ranks(__file__, tmp_path, world, scenario, timeout)


def _check_cases(results: list[dict]) -> dict[str, list[dict]]:
    cases: dict[str, list[dict]] = {}
    for rank_result in results:
        for case in rank_result["cases"]:
            cases.setdefault(case["name"], []).append(case)
    for name, per_rank in cases.items():
        for case in per_rank:
            assert case["grad_rel_err"] < 1e-4, (name, case)
            assert case["num_params"] > 0, (name, case)
        losses = [c["loss"] for c in per_rank if c["loss"] is not None]
        assert len(losses) == 1, name
        assert losses[0] == pytest.approx(per_rank[0]["reference_loss"], rel=1e-4), name
        owned = sorted(b for c in per_rank for b in c["blocks"])
        assert owned == list(range(per_rank[0]["num_blocks"])), name
    return cases


def test_two_ranks_on_one_gpu_over_gloo(tmp_path):
    cases = _check_cases(_run_workers(tmp_path, 2, "gloo_gpu"))
    assert set(cases) == {"mlp-gpipe", "mlp-1f1b", "lm-1f1b-auto"}
    for per_rank in cases.values():
        assert [c["device"] for c in per_rank] == ["cuda:0", "cuda:0"]
        assert [c["runtime"] for c in per_rank] == ["LeanPipeline"] * 2
    print(cases["lm-1f1b-auto"][0]["plan_text"])


def test_cpu_and_gpu_stages_in_one_pipeline(tmp_path):
    cases = _check_cases(_run_workers(tmp_path, 2, "mixed"))
    per_rank = cases["lm-1f1b-auto"]
    assert [c["device"] for c in per_rank] == ["cpu", "cuda:0"]
    plan = per_rank[0]["plan"]
    print(per_rank[0]["plan_text"])
    cpu_blocks, gpu_blocks = (s["blocks"][1] - s["blocks"][0] for s in plan["stages"])
    # planned from each rank's own block times: the GPU stage takes the larger share
    assert cpu_blocks < gpu_blocks
    assert plan["stages"][0]["device"].endswith("cpu")
    assert plan["stages"][1]["device"].endswith("cuda:0")


def test_one_stage_on_nccl(tmp_path):
    cases = _check_cases(_run_workers(tmp_path, 1, "nccl_single"))
    assert cases["mlp-torch-1f1b"][0]["runtime"] == "TorchPipeline"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_two_gpus_over_nccl_with_torch_schedules(tmp_path):
    cases = _check_cases(_run_workers(tmp_path, 2, "nccl"))
    assert set(cases) == {"mlp-torch-gpipe", "mlp-torch-1f1b", "mlp-torch-interleaved_1f1b"}


# ---------------------------------------------------------------- the worker side


def _worker(scenario: str, rank: int, world: int, port: int, out_dir: str) -> None:
    import copy

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for rank_scripts
    from rank_scripts import unsplit_reference

    from torchrelay.spec import PipelineStrategy
    from torchrelay.train.pipeline import build_on_meta, prepare
    from torchrelay.train.pipeline.models import balanced_mlp, char_transformer, lm_loss, mse_loss

    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # compare with float32 products
    torch.backends.cudnn.allow_tf32 = False
    backend = "nccl" if scenario.startswith("nccl") else "gloo"
    if scenario == "mixed":
        device = torch.device("cpu" if rank == 0 else "cuda:0")
    else:
        device = torch.device(f"cuda:{rank if scenario == 'nccl' else 0}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)

    def run_case(name, make_blocks, data, loss_fn, schedule, runtime, plan, seed=3,
                 microbatches=4):
        inputs, targets, sample, sample_target = data
        meta = build_on_meta(make_blocks)
        strategy = PipelineStrategy(kind="pipeline", microbatches=microbatches,
                                    schedule=schedule)
        pipe = prepare(copy.deepcopy(meta), loss_fn, strategy, sample=sample.to(device),
                       sample_target=sample_target.to(device), plan=plan, runtime=runtime,
                       seed=seed, device=device)
        full, ref_loss = unsplit_reference(meta, seed, inputs, targets, loss_fn, microbatches)
        for _ in range(3):  # the first step learns the shapes, the next ones reuse buffers
            pipe.module.zero_grad(set_to_none=True)
            loss = pipe.step(inputs.to(device) if pipe.is_first else None,
                             targets.to(device) if pipe.is_last else None)
        err, num_params = 0.0, 0
        for i, block in pipe.blocks.items():
            for p, q in zip(block.parameters(), full[i].parameters()):
                diff = (p.grad.cpu() - q.grad).abs().max().item()
                err = max(err, diff / (q.grad.abs().max().item() + 1e-12))
                num_params += p.numel()
        return {"name": name, "loss": None if loss is None else loss.item(),
                "reference_loss": ref_loss, "grad_rel_err": err, "num_params": num_params,
                "blocks": sorted(pipe.blocks), "num_blocks": len(meta),
                "device": str(device), "runtime": type(pipe.runner).__name__,
                "plan": pipe.plan.to_dict(), "plan_text": pipe.plan.describe()}

    torch.manual_seed(0)
    mlp = (torch.randn(16, 64), torch.randn(16, 64), torch.randn(4, 64), torch.randn(4, 64))
    vocab, context = 4096, 16
    tokens = torch.randint(0, vocab, (8, context + 1))
    lm = (tokens[:, :-1], tokens[:, 1:], tokens[:2, :-1], tokens[:2, 1:])

    def make_mlp():
        return balanced_mlp(64, 6)

    def make_lm():
        return char_transformer(vocab, 64, 6, 4, context)

    cases = []
    if scenario == "gloo_gpu":
        for schedule in ("gpipe", "1f1b"):
            cases.append(run_case(f"mlp-{schedule}", make_mlp, mlp, mse_loss, schedule, "lean",
                                  [0, 3]))
        cases.append(run_case("lm-1f1b-auto", make_lm, lm, lm_loss, "1f1b", "lean", None,
                              microbatches=2))
    elif scenario == "mixed":
        # wide enough that a GPU block outruns a CPU block (tiny ones are launch-bound there)
        wide_tokens = torch.randint(0, 8192, (8, 33))
        wide = (wide_tokens[:, :-1], wide_tokens[:, 1:], wide_tokens[:4, :-1],
                wide_tokens[:4, 1:])
        cases.append(run_case("lm-1f1b-auto", lambda: char_transformer(8192, 256, 6, 4, 32),
                              wide, lm_loss, "1f1b", "lean", None, microbatches=2))
    elif scenario == "nccl_single":
        cases.append(run_case("mlp-torch-1f1b", make_mlp, mlp, mse_loss, "1f1b", "torch",
                              None))
    elif scenario == "nccl":
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
            plan = [0, 2, 3, 5] if schedule == "interleaved_1f1b" else [0, 3]
            cases.append(run_case(f"mlp-torch-{schedule}", make_mlp, mlp, mse_loss, schedule,
                                  "torch", plan))
    Path(out_dir, f"{scenario}-{rank}.json").write_text(json.dumps({"cases": cases}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
