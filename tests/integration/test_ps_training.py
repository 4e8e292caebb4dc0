"""Parameter-server training in real processes on 127.0.0.1.

Each test starts W workers + S server ranks of ``test_ps_job.py`` (the store: a TCPStore on
an OS-chosen port, hosted here; or torchrun's own) and reads what every worker wrote.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("test_ps_job.py")
sys.path.insert(0, str(JOB.parent))
from test_ps_job import digits, make_model  # noqa: E402  (the job's own data and model)


class Job:
    """W + S processes of the job script, each in its own session; killed on exit."""

    def __init__(self, cfg: dict, out: Path, torchrun: bool = False) -> None:
        self.workers = cfg["workers"]
        self.servers = cfg["strategy"].get("servers", 1)
        self.out = out
        self.store = None
        data = out / "digits.pt"
        digits(str(data))  # once here, so no worker pays for importing sklearn
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                   PS_JOB=json.dumps({**cfg, "out": str(out), "data": str(data)}))
        env.pop("RELAY_PS_STORE", None)
        world = self.workers + self.servers
        if torchrun:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "--log-dir", str(out / "torchrun"), str(JOB), "--torchrun"]
            self.procs = [subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True)]
            return
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        env["RELAY_PS_STORE"] = f"127.0.0.1:{self.store.port}"
        self.procs = [subprocess.Popen([sys.executable, str(JOB)], cwd=REPO, start_new_session=True,
                                       env={**env, "RANK": str(r), "WORLD_SIZE": str(world)})
                      for r in range(world)]

    def wait(self, timeout: float = 100) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]

    def results(self) -> list[dict]:
        return [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(self.workers)]

    def params(self, rank: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"rank{rank}.pt")

    def kill(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


@pytest.fixture
def job(tmp_path):
    started: list[Job] = []

    def start(cfg: dict, torchrun: bool = False) -> Job:
        j = Job(cfg, tmp_path, torchrun)
        started.append(j)
        return j

    yield start
    for j in started:
        j.kill()


def ps_strategy(mode: str, servers: int = 1, **extra) -> dict:
    return {"kind": "parameter_server", "servers": servers, "mode": mode, **extra}


def reference_equiv(steps: int, workers: int, batch: int, lr: float, momentum: float) -> dict:
    """The same training in one process on the combined batch (what sync must equal)."""
    X, y = digits()
    X, y = X[:1400], y[:1400]
    model = make_model(32)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for t in range(steps):
        idx = torch.cat([torch.arange(b, b + batch) for b in
                         ((t * workers * batch + r * batch) % (len(X) - batch) for r in range(workers))])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
    return model.state_dict()


def assert_params_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


def test_sync_equals_single_process_through_a_shard_kill_under_torchrun(job):
    """Two workers and two shards (tensors split across them), launched by torchrun: the
    default process group's store carries the addresses. Worker 0 SIGKILLs shard 0's
    process while worker 1 waits inside round 10; the supervisor restarts it on the shared
    state, both workers reconnect and resend, every process exits 0, and the parameters
    still equal single-process training on the combined batch."""
    cfg = {"workers": 2, "task": "equiv", "steps": 20, "batch": 16,
           "kill_shard": {"rank": 0, "step": 10, "shard": 0},
           "strategy": ps_strategy("sync", servers=2, optimizer={"name": "sgd", "lr": 0.2, "momentum": 0.9})}
    j = job(cfg, torchrun=True)
    assert j.wait() == [0]
    results = j.results()
    assert [r["generations"] for r in results] == [[2, 1], [2, 1]]
    assert all(r["ps_reconnects"] >= 1 for r in results)
    assert all(r["ps_shm_shards"] == 2 for r in results)  # the restarted shard mapped the regions again
    assert all(r["ps_staleness_max"] == 0 for r in results)
    want = reference_equiv(20, 2, 16, lr=0.2, momentum=0.9)
    for rank in range(2):
        assert_params_close(j.params(rank), want)


def test_async_trains_digits_and_does_not_wait_for_a_held_back_worker(job):
    """Worker 1 stops after its first step until worker 0 has done 12 steps: with async,
    worker 0 gets there (it would deadlock if it waited), running 8+ clocks ahead."""
    # 8 epochs, not 5: with 5, test accuracy landed at 0.93-0.95 in some runs on a loaded
    # machine (before and after the overlapped-reply change alike): async's interleaving varies.
    cfg = {"workers": 2, "task": "digits", "epochs": 8, "batch": 32, "hidden": 64,
           "slow": {"rank": 1, "hold_until_peer_steps": 12},
           "strategy": ps_strategy("async", optimizer={"name": "adam", "lr": 0.01})}
    j = job(cfg)
    assert j.wait() == [0, 0, 0]
    fast, slow = j.results()
    assert fast["ps_staleness_max"] >= 8 > 2
    # the held-back worker ends last, so its pull holds every update: the job's final model. The
    # fast worker's pull is a snapshot about 12 updates before that, in the middle of the held-back
    # worker's stale pushes (0.947 once in a fresh clone, while the final model scored 0.975): how
    # far into them depends on the interleaving, so it is held to a lower bound than the final model
    assert slow["acc"] >= 0.95 and fast["acc"] >= 0.9, (slow["acc"], fast["acc"])


def test_ssp_bounds_staleness_with_a_slowed_worker_and_trains_digits(job):
    cfg = {"workers": 2, "task": "digits", "epochs": 5, "batch": 32, "hidden": 64,
           "slow": {"rank": 1, "pause_s": 1.0, "sleep_s": 0.005},
           "strategy": ps_strategy("ssp", staleness=2, optimizer={"name": "adam", "lr": 0.01})}
    j = job(cfg)
    assert j.wait() == [0, 0, 0]
    fast, slow = j.results()
    assert fast["ps_staleness_max"] <= 2 and slow["ps_staleness_max"] <= 2
    assert fast["ps_staleness_max"] == 2, "the fast worker should have run up to the bound"
    assert min(fast["acc"], slow["acc"]) >= 0.95
