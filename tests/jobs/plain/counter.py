"""Prints and reports a numbered line every 0.1 s, N times (argv[1], default 60), then exits 0."""
import sys
import time

import torchrelay.train as rt

rt.init()
count = int(sys.argv[1]) if len(sys.argv) > 1 else 60
for i in range(count):
    print(f"line {i}", flush=True)
    rt.report(i, value=float(i))
    time.sleep(0.1)
rt.shutdown()
