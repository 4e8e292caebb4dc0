"""A one-rank trainer whose store goes away between two checkpoints (tests/integration/test_cluster_s3.py).

    python outage.py GATE_DIR

Checkpoints (sync, through ``TrainState.save``) at steps 2, 4 and 6 of 8. After the save of
step 2 it writes ``GATE_DIR/saved-2`` and waits for ``GATE_DIR/go-4`` (the test takes the S3
gateway away meanwhile), so the save of step 4 meets no store; after it, ``after-4`` and a wait
for ``go-6`` (the test brings the gateway back). Rank 0 saves ``model.pt`` at the end.
"""
import os
import sys
import time

import torch

import torchrelay.train as rt

GATES = sys.argv[1]


def gate(done: str, wait_for: str) -> None:
    open(os.path.join(GATES, done), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(GATES, wait_for)):
        if time.monotonic() > deadline:
            sys.exit(f"{wait_for} never came")
        time.sleep(0.05)


def main() -> None:
    rt.init()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    state = rt.TrainState(model, optimizer, rt.shard(data, batch_size=1, shuffle=False))
    for _epoch in state.epochs(1):
        for x, y in state.batches():
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            rt.report(state.step, loss=1.0)
            if state.step in (2, 4, 6):
                url = state.save(async_=False)
                print(f"step {state.step}: checkpoint {url or 'FAILED'}", flush=True)
            if state.step == 2:
                gate("saved-2", "go-4")
            if state.step == 4:
                rt.flush_metrics()
                gate("after-4", "go-6")
    rt.save_artifact("model.pt", model.state_dict())
    rt.shutdown()


main()
