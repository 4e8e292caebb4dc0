"""A small real training job for the dashboard tests: each rank fits its own linear model.

argv: steps, seconds between steps[, a folder]. Every step reports loss (different on each
rank), samples_per_s and total_steps, and prints `rank R step S loss L`; a checkpoint is saved
halfway and rank 0 saves the model as the artifact `model.pt` at the end. With a folder, the
ranks wait after steps 5 and 3/4 of the way until the files `hold-5` and `hold-<step>` are in
it (the test's agents run on its own machine), so a test can act while the job surely trains.
"""
import sys
import time
from pathlib import Path

import torch

import torchrelay.train as rt

ctx = rt.init()
steps, pause = int(sys.argv[1]), float(sys.argv[2])
holds = Path(sys.argv[3]) if len(sys.argv) > 3 else None
gen = torch.Generator().manual_seed(ctx.rank)
x = torch.randn(256, 8, generator=gen)
y = x @ torch.arange(8.0) + 0.1 * (ctx.rank + 1) * torch.randn(256, generator=gen)
w = torch.zeros(8, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.05)
for step in range(steps):
    if rt.should_stop():
        break
    t0 = time.perf_counter()
    loss = torch.nn.functional.mse_loss(x @ w, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    rt.report(step, loss=loss.item(), samples_per_s=256 / (time.perf_counter() - t0), total_steps=steps)
    print(f"rank {ctx.rank} step {step} loss {loss.item():.4f}", flush=True)
    if step == steps // 2:
        rt.save_checkpoint({"w": w.detach().clone(), "step": step}, step)
    if holds is not None and step in (5, 3 * steps // 4):
        rt.flush_metrics()
        deadline = time.monotonic() + 300
        while not (holds / f"hold-{step}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(pause)
if ctx.rank == 0:
    rt.save_artifact("model.pt", {"w": w.detach()})
rt.shutdown()
