"""Ranks of a test file run as a script, owned: each rank's process group is killed on the way out.

Not a test module. A test file that is also its own worker script
(``python <file> <scenario> <rank> <world> <port> <out_dir>``, each rank writing
``<out_dir>/<scenario>-<rank>.json``) calls ``run_ranks(__file__, ...)`` from inside a test,
importing this module there, because ``tests/`` is not on ``sys.path`` when the file runs as
a worker. A worker imports ``unsplit_reference`` after putting ``tests/`` on its path.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, tmp_path: Path, world: int, scenario: str,
              timeout: float = 180) -> list[dict]:
    """Start ``world`` ranks of ``script`` on 127.0.0.1 (a free port) and return each rank's
    JSON result. Blocks; asserts every rank exited 0, showing a failed rank's output."""
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    procs = []
    try:
        for rank in range(world):
            procs.append(subprocess.Popen(
                [sys.executable, script, scenario, str(rank), str(world), str(port),
                 str(tmp_path)],
                env=env, start_new_session=True, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT))
        outputs = [proc.communicate(timeout=timeout)[0].decode(errors="replace")
                   for proc in procs]
        for rank, proc in enumerate(procs):
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{outputs[rank]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [json.loads((tmp_path / f"{scenario}-{rank}.json").read_text())
            for rank in range(world)]


def unsplit_reference(meta_blocks, seed: int, inputs, targets, loss_fn, microbatches: int):
    """The unsplit model on the CPU (block ``i`` initialised under ``seed + i``, as a pipeline
    stage materialises it), stepped on the same micro-batches with gradient accumulation and
    each loss weighted by its share of the batch. Returns (blocks, summed loss)."""
    import copy

    import torch

    from torchrelay.train.pipeline import materialize_module

    full = [materialize_module(copy.deepcopy(b), "cpu", seed + i)
            for i, b in enumerate(meta_blocks)]
    model = torch.nn.Sequential(*full)
    total = 0.0
    for x, y in zip(torch.tensor_split(inputs, microbatches),
                    torch.tensor_split(targets, microbatches)):
        loss = loss_fn(model(x), y) * (x.shape[0] / inputs.shape[0])
        loss.backward()
        total += loss.item()
    return full, total
