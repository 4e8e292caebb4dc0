"""A plain DDP step loop for bench/multihost.py: run by the platform and by raw torchrun alike.

Each rank trains an MLP (4 × 1024 wide: about 4 M parameters, 16 MB of gradients per
all-reduce) for ``STEPS`` steps after ``WARMUP``; rank 0 prints ``STEP_MEDIAN_S=<seconds>``.
"""
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

STEPS, WARMUP = 40, 5

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    *[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()) for _ in range(4)]))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 1024)
times = []
for step in range(STEPS + WARMUP):
    t0 = time.perf_counter()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(f"STEP_MEDIAN_S={statistics.median(times[WARMUP:]):.6f}", flush=True)
del model, opt
gc.collect()  # DDP's reducer sits in a reference cycle (docs/design.md, exit-time abort)
dist.destroy_process_group()
if not os.environ.get("RELAY_LAUNCH_ID"):  # raw torchrun: spare it the teardown abort; the platform's hook does
    os._exit(0)
