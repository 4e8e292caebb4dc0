"""One torchft replica group of one worker for ``bench/recovery.py``'s peer figure: the same
model, data and global batch as ``tests/jobs/elastic/train.py`` (its ``problem.py``), trained through torchft's
Manager (gloo, its lighthouse at ``TORCHFT_LIGHTHOUSE``), each committed step logged with its
time to ``$OUT/member-<id>.jsonl``. Not a test and not part of torchrelay.

    python bench/_torchft_worker.py REPLICA_ID REPLICAS STEPS STEP_SLEEP
"""
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "jobs", "elastic"))
from problem import GLOBAL_BATCH, SAMPLES, make_problem  # noqa: E402  (the elastic job's own problem)

replica, replicas, steps, step_sleep = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
X, Y, model, inner = make_problem()
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's own
manager = Manager(
    pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)), min_replica_size=2,
    load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["opt"])),
    state_dict=lambda: {"model": model.state_dict(), "opt": inner.state_dict()},
    replica_id=f"replica-{replica}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
    timeout=datetime.timedelta(seconds=10), quorum_timeout=datetime.timedelta(seconds=10))
ddp = DistributedDataParallel(manager, model)
optimizer = Optimizer(manager, inner)
log = open(os.path.join(os.environ["OUT"], f"member-{replica}.jsonl"), "a")
while manager.current_step() < steps:
    optimizer.zero_grad()  # starts the step's quorum
    step = manager.current_step()
    idx = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(step))[:GLOBAL_BATCH // replicas]
    loss = torch.nn.functional.mse_loss(ddp(X[idx]), Y[idx])
    loss.backward()
    if manager.should_commit():  # what torchft's OptimizerWrapper.step does, with the verdict kept
        inner.step()
        log.write(json.dumps({"step": step, "time": time.time(), "pid": os.getpid(),
                              "participants": manager.num_participants()}) + "\n")
        log.flush()
    time.sleep(step_sleep)
manager.shutdown()
