"""Warm multi-rank launches on real processes: every rank forked from a zygote that imported
torch, against real torchrun launches of the same scripts (environment, trained parameters),
the cases an unchanged torchrun script relies on, a zygote that keeps nothing of a job, and
the fallbacks to torchrun."""
from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from conftest import group_members
from torchrelay import wire
from torchrelay.agent.backends import BackendKind
from torchrelay.agent.launcher import Launch, pick_free_port
from torchrelay.agent.zygote import Zygote

pytestmark = pytest.mark.timeout(240)

DDP = """
import json, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
with open(os.path.join(os.environ["OUT"], f"env-{rank}.json"), "w") as fh:
    json.dump(dict(os.environ), fh)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
data = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 8, generator=data), torch.randn(64, 1, generator=data)
for step in range(6):
    xs, ys = x[step * 8:(step + 1) * 8][rank::world], y[step * 8:(step + 1) * 8][rank::world]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(xs), ys).backward()
    opt.step()
if rank == 0:
    torch.save(model.module.state_dict(), os.path.join(os.environ["OUT"], "params.pt"))
"""

# What a new user types for torchrun, untouched: a __main__ guard, argparse, @record, a
# sibling import, the default backend, LOCAL_RANK, a DataLoader with worker processes, a
# signal handler of its own, and an exception that @record must put in the error file.
USER = """
import argparse, os, signal, sys
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from helper import VALUE

parser = argparse.ArgumentParser()
parser.add_argument("--boom", action="store_true")


@record
def main():
    args = parser.parse_args()
    assert __name__ == "__main__" and sys.argv[0].endswith("user.py") and __file__.endswith("user.py")
    signal.signal(signal.SIGUSR1, lambda *_: None)
    dist.init_process_group()
    local = int(os.environ["LOCAL_RANK"])
    torch.manual_seed(local)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2)
    batches = sum(1 for _ in loader)
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    if args.boom and dist.get_rank() == 1:
        raise RuntimeError("boom from rank 1")
    print(f"ok rank {dist.get_rank()} local {local} value {VALUE} sum {t.item():g} batches {batches}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""

PROBE = """
import json, os, random, signal, sys
import numpy as np
import torch

def fds():
    out = []
    for fd in sorted(int(f) for f in os.listdir("/proc/self/fd")):
        try:
            out.append([fd, os.readlink(f"/proc/self/fd/{fd}").split(":")[0]])
        except OSError:
            pass
    return out

probe = {
    "env": sorted(os.environ),
    "modules": sorted(sys.modules),
    "fds": fds(),
    "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
    "torch_seed": torch.initial_seed(), "torch_rand": torch.rand(3).tolist(),
    "numpy": np.random.rand(2).tolist(), "random": random.random(),
}
with open(os.path.join(os.environ["OUT"], f"{sys.argv[1]}-{os.environ['RANK']}.json"), "w") as fh:
    json.dump(probe, fh)
"""

POLLUTE = """
import os, random, signal, sys
import numpy as np
import torch
import leakmod
os.environ["LEAKED_VARIABLE"] = "1"
kept = open(os.path.join(os.environ["OUT"], "kept-open.txt"), "w")
os.set_inheritable(kept.fileno(), True)
signal.signal(signal.SIGUSR1, lambda *_: None)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
torch.manual_seed(123); torch.rand(5)
np.random.seed(1); random.seed(1)
sys.modules["injected_by_a_job"] = leakmod
print("polluted", flush=True)
"""


def make_launch(tmp_path: Path, name: str, script: str, *args: str, zygote: Zygote | None = None,
                env: dict | None = None, backend: BackendKind | None = None, nproc: int = 2) -> Launch:
    code = tmp_path / "code"
    code.mkdir(parents=True, exist_ok=True)
    (code / f"{name}.py").write_text(textwrap.dedent(script))
    (code / "helper.py").write_text("VALUE = 7\n")
    (code / "leakmod.py").write_text("LEAK = True\n")
    (tmp_path / "out").mkdir(exist_ok=True)
    assignment = wire.LaunchAssignment(
        launch_id=f"{name}-{os.getpid()}-{time.monotonic_ns()}", job_id="job-w", attempt=0, desired="run",
        node_rank=0, nnodes=1, nproc_per_node=nproc, world_size=nproc, rank_offset=0,
        entrypoint=["python", f"{name}.py", *args], bundle=None, env={"OUT": str(tmp_path / "out"), **(env or {})},
        store_url=str(tmp_path / "store"), job_store_prefix="jobs/job-w")
    return Launch(assignment, code_dir=code, run_dir=tmp_path / f"run-{name}-{time.monotonic_ns()}",
                  warm_zygote=zygote, backend=backend)


def run(launch: Launch, launches: list) -> wire.LaunchStatus:
    launches.append(launch)
    launch.start("127.0.0.1", pick_free_port())
    status = launch.wait(timeout=180)
    assert status is not None, "the launch did not end"
    return status


def warm_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def warm_zygote():
    zygote = Zygote(env=warm_env(), preload=("torch",))
    yield zygote
    zygote.close()


def test_a_warm_launch_gives_torchruns_environment_and_trains_the_same_parameters(tmp_path, warm_zygote,
                                                                                   launches):
    import torch

    runs = {}
    for how in ("torchrun", "warm"):
        launch = make_launch(tmp_path / how, "ddp", DDP, zygote=warm_zygote,
                             backend=BackendKind.TORCHRUN if how == "torchrun" else None)
        status = run(launch, launches)
        assert status.succeeded, status
        assert launch.forked is (how == "warm")
        runs[how] = launch
    assert (runs["warm"].run_dir / "launch.log").read_text().count("forked by the warm zygote") == 2
    for rank in (0, 1):
        envs = {}
        for how, launch in runs.items():
            env = json.loads((tmp_path / how / "out" / f"env-{rank}.json").read_text())
            envs[how] = {k: v.replace(str(launch.run_dir), "RUN").replace(str(tmp_path / how), "TMP")
                         .replace(launch.launch_id, "LAUNCH") for k, v in env.items()}
        torchrun, warm = envs["torchrun"], envs["warm"]
        assert sorted(warm) == sorted(torchrun), (set(warm) ^ set(torchrun))
        differ = {k for k in torchrun if torchrun[k] != warm[k]}
        assert differ == {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}, {k: (torchrun[k], warm[k]) for k in differ}
        assert warm["TORCHELASTIC_USE_AGENT_STORE"] == "True" and warm["RANK"] == str(rank)
        assert warm["TORCHELASTIC_ERROR_FILE"] == f"RUN/errors/rank-{rank}.json"
    ours = torch.load(tmp_path / "warm" / "out" / "params.pt")
    theirs = torch.load(tmp_path / "torchrun" / "out" / "params.pt")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_an_unchanged_torchrun_script_runs_warm(tmp_path, warm_zygote, launches):
    launch = make_launch(tmp_path, "user", USER, zygote=warm_zygote)
    status = run(launch, launches)
    assert launch.forked and status.succeeded, status
    assert sorted(r.last_lines[-1] for r in status.ranks) == [
        "ok rank 0 local 0 value 7 sum 3 batches 4", "ok rank 1 local 1 value 7 sum 3 batches 4"]


def test_a_failing_rank_ends_its_peer_and_record_writes_its_error_file(tmp_path, warm_zygote, launches):
    launch = make_launch(tmp_path, "user", USER, "--boom", zygote=warm_zygote)
    status = run(launch, launches)
    assert launch.forked and status.succeeded is False
    failed = {r.rank: r for r in status.ranks}
    assert failed[1].exit_code == 1 and not failed[1].returned
    assert any("boom from rank 1" in line for line in failed[1].last_lines)
    error = json.loads((launch.run_dir / "errors" / "rank-1.json").read_text())
    assert "boom from rank 1" in json.dumps(error)
    assert status.message.startswith("rank 1: exit code 1")


def test_stop_ends_every_rank_and_the_store(tmp_path, warm_zygote, launches):
    launch = make_launch(tmp_path, "hang", "import time\nimport torch.distributed as dist\n"
                         "dist.init_process_group('gloo'); print('ready', flush=True); time.sleep(600)\n",
                         zygote=warm_zygote)
    launches.append(launch)
    launch.start("127.0.0.1", pick_free_port())
    deadline = time.monotonic() + 120
    ready = 0
    while ready < 2:
        ready += sum(r.text == "ready" for r in launch.take_logs())
        assert launch.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    groups = [r.pid for r in launch.backend.ranks] + [launch.backend.store_pid]
    status = launch.stop(grace_s=5)
    assert status.stopped and not status.succeeded
    assert {r.signal for r in status.ranks} == {signal.SIGTERM}
    assert all(group_members(pgid) == [] for pgid in groups)


def probe(tmp_path: Path, zygote: Zygote, name: str, launches: list) -> list[dict]:
    status = run(make_launch(tmp_path, "probe", PROBE, name, zygote=zygote), launches)
    assert status.succeeded, status
    return [json.loads((tmp_path / "out" / f"{name}-{rank}.json").read_text()) for rank in (0, 1)]


def test_the_zygote_keeps_nothing_of_an_earlier_job(tmp_path, launches):
    zygote = Zygote(env=warm_env(), preload=("torch",))
    try:
        before = probe(tmp_path, zygote, "before", launches)
        polluter = make_launch(tmp_path, "pollute", POLLUTE, zygote=zygote)
        status = run(polluter, launches)
        assert polluter.forked and status.succeeded, status
        after = probe(tmp_path, zygote, "after", launches)
    finally:
        zygote.close()
    for rank in (0, 1):
        b, a = before[rank], after[rank]
        for key in ("env", "modules", "fds", "signals"):
            assert a[key] == b[key], key
        assert "LEAKED_VARIABLE" not in a["env"] and "leakmod" not in a["modules"]
        assert "injected_by_a_job" not in a["modules"]
        assert a["signals"]["SIGUSR1"] == a["signals"]["SIGTERM"] == repr(signal.SIG_DFL)
        assert not any(path.endswith("kept-open.txt") for _, path in a["fds"])
    # seeded from entropy in each worker, as in a fresh interpreter: no stream repeats
    numbers = [p[key] for p in before + after for key in ("torch_seed", "torch_rand", "numpy", "random")]
    assert len({json.dumps(n) for n in numbers}) == len(numbers), "a random stream repeats across ranks or jobs"


PLAIN = "import os\nprint('ok rank', os.environ['RANK'], flush=True)\n"  # torchrun alone imports torch


def test_a_job_that_asks_for_fresh_interpreters_goes_through_torchrun(tmp_path, warm_zygote, launches):
    launch = make_launch(tmp_path, "plain", PLAIN, zygote=warm_zygote, env={"RELAY_FRESH_INTERPRETER": "1"})
    status = run(launch, launches)
    assert status.succeeded, status
    assert launch.kind is BackendKind.WARM and launch.forked is False
    assert launch.note == "started through torchrun: the job asks for fresh interpreters (RELAY_FRESH_INTERPRETER=1)"
    assert "not forked warm" in (launch.run_dir / "torchrun.log").read_text()


@pytest.mark.slow  # torchrun's own start-up, ~20 s on 2 loaded cores; the other fallback runs in make test
def test_a_zygote_that_cannot_fork_falls_back_to_torchrun(tmp_path, launches):
    broken = Zygote(env=warm_env(), preload=("torch", "no_such_module_for_the_zygote"))
    try:
        launch = make_launch(tmp_path, "plain", PLAIN, zygote=broken)
        status = run(launch, launches)
    finally:
        broken.close()
    assert status.succeeded, status
    assert launch.forked is False and launch.note.startswith("started through torchrun: the warm zygote could not")
    assert sorted(r.last_lines[-1] for r in status.ranks) == ["ok rank 0", "ok rank 1"]
