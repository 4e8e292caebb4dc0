"""Reports what a balanced data-parallel rank reports (``share``, ``measured_samples_per_s``,
``idle_fraction``), without training: the dashboard's shares view is tested against these.

argv: steps, seconds between steps. Until step 5 the two ranks hold equal shares; from step 5
rank 0 holds 85 and rank 1 43 (what a re-split after measuring 2:1 speeds gives)."""
import sys
import time

import torchrelay.train as rt

ctx = rt.init()
steps, pause = int(sys.argv[1]), float(sys.argv[2])
for step in range(steps):
    if rt.should_stop():
        break
    share = 64 if step < 5 else (85 if ctx.rank == 0 else 43)
    speed = 4200.0 if ctx.rank == 0 else 2100.0
    rt.report(step, loss=1.0 / (step + 1), share=share, measured_samples_per_s=speed,
              idle_fraction=0.03 if ctx.rank == 0 else 0.01, total_steps=steps)
    rt.flush_metrics()
    time.sleep(pause)
rt.shutdown()
