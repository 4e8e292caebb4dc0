"""Reports step 0..N-1 (argv[1]) every 50 ms: bench/multihost.py's failover job."""
import sys
import time

import torchrelay.train as rt

rt.init()
for step in range(int(sys.argv[1])):
    rt.report(step, value=float(step))
    time.sleep(0.05)
rt.shutdown()
