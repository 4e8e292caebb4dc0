"""fsdp on GPUs: NCCL, bf16 mixed precision, the optimizer state offloaded to CPU memory. Skips without CUDA.

Also the worker script (``python test_sharded_gpu.py SCENARIO RANK WORLD PORT OUT_DIR``). Ranks: one per
visible GPU, at most two (NCCL wants one GPU per rank).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, bf16, offload)")]


def worker(scenario: str, rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RELAY_STRATEGY=json.dumps({"kind": "fsdp", "mixed_precision": "bf16",
                                                 "offload_optimizer": True}))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_sharded as cpu  # the models, batches and the one-process reference

    import torchrelay.train as rt

    ctx = rt.init()
    torch.manual_seed(0)
    model = cpu.MODELS["buffers"]()
    model, opt = rt.prepare(model, torch.optim.Adam(model.parameters(), lr=cpu.LR))
    share = cpu.BATCH // world
    for step in range(1, cpu.STEPS + 1):
        x, y = cpu.batch(step)
        mine = slice(rank * share, (rank + 1) * share)
        torch.nn.functional.mse_loss(model(x[mine].to(ctx.device)).float(), y[mine].to(ctx.device)).backward()
        opt.step()
        opt.zero_grad()
    full = rt.full_state_dict(model)
    out = {"backend": ctx.backend, "param_devices": sorted({p.device.type for p in model.parameters()}),
           "metrics": opt.metrics()}
    if rank == 0:
        expected, _ = cpu.reference("buffers", cpu.STEPS)
        keys = [k for k in expected if k != "0.calls"]
        diff = torch.cat([(full[k].float() - expected[k].float()).flatten() for k in keys])
        out["relative_diff"] = (diff.norm() / torch.cat([expected[k].flatten() for k in keys]).norm()).item()
    rt.shutdown()
    Path(out_dir, f"{scenario}-{rank}.json").write_text(json.dumps(out))


def test_fsdp_on_gpus_with_bf16_and_offload(tmp_path: Path) -> None:
    from rank_scripts import run_ranks

    results = run_ranks(__file__, tmp_path, min(2, torch.cuda.device_count()), "gpu", timeout=500)
    assert all(r["backend"] == "nccl" for r in results)
    assert all(r["param_devices"] == ["cpu"] for r in results)  # sharded parameters offloaded to CPU memory
    assert all(r["metrics"]["memory_peak_allocated"] > 0 for r in results)
    assert results[0]["relative_diff"] < 0.05, results[0]  # bf16: near the float32 run (as on CPU)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
