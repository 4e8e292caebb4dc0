"""Synchronisation strategies on two real gloo ranks, checked against single-process math.

One two-rank launch (``torch.multiprocessing``, spawn, 127.0.0.1, a port picked free here)
runs every scenario and saves what each rank saw; the tests below compare that with a
single-process simulation of the same algorithm written out by hand (two model replicas
in one process, averaged explicitly). Processes are daemonic, joined with a deadline and
killed in ``finally``.
"""
from __future__ import annotations

import gc
import io
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from torchrelay.spec import DDPStrategy, DiLoCoStrategy, FinalAverageStrategy, LocalSGDStrategy
from torchrelay.train import sync

pytestmark = pytest.mark.timeout(180)

WORLD = 2
PER_RANK = 16
STEPS = 10

STRATEGIES = {
    "ddp": DDPStrategy(),
    "local_sgd_h1": LocalSGDStrategy(kind="local_sgd", every=1),
    "local_sgd_h3_w2": LocalSGDStrategy(kind="local_sgd", every=3, warmup_steps=2),
    "local_sgd_h3": LocalSGDStrategy(kind="local_sgd", every=3),
    "diloco_plain_h3": DiLoCoStrategy(kind="diloco", every=3, outer_lr=1.0, outer_momentum=0.0),
    "diloco_h3": DiLoCoStrategy(kind="diloco", every=3, outer_lr=0.7, outer_momentum=0.9),
    "final_average": FinalAverageStrategy(kind="final_average"),
}
# (strategy, inner optimizer) pairs the trace scenario runs; final_average checkpoints at step 4
TRACES = [("ddp", "sgd"), ("local_sgd_h1", "sgd"), ("local_sgd_h3_w2", "sgd"), ("local_sgd_h3", "sgd"),
          ("diloco_plain_h3", "sgd"), ("diloco_h3", "adam"), ("final_average", "sgd")]
CHECKPOINT_AT = 4


@dataclass
class Ctx:
    rank: int
    world_size: int
    device: str = "cpu"


# ---------------------------------------------------------------- shared by ranks and the simulation

_DIGITS: tuple[torch.Tensor, ...] | None = None


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sklearn digits, shuffled once with a fixed seed: (x_train, y_train, x_test, y_test)."""
    global _DIGITS
    if _DIGITS is None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        order = np.random.default_rng(0).permutation(len(x))
        x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
        y = torch.tensor(y[order], dtype=torch.long)
        _DIGITS = (x[:1437], y[:1437], x[1437:], y[1437:])
    return _DIGITS  # type: ignore[return-value]


def make_model(seed: int = 0, hidden: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s half of step ``step``'s batch: the same on every run."""
    x, y, _, _ = digits()
    idx = torch.from_numpy(np.random.default_rng(1000 + step).choice(len(x), PER_RANK * WORLD, replace=False))
    mine = idx[rank * PER_RANK:(rank + 1) * PER_RANK]
    return x[mine], y[mine]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------- what each rank runs


def _train(strategy, opt_kind: str, rank: int, first: int, last: int, model=None, opt=None,
           checkpoint_at: int | None = None):
    if model is None:
        model, opt = make_model(), None
        opt = make_optimizer(opt_kind, model.parameters())
        model, opt = sync.prepare(model, opt, strategy, Ctx(rank, WORLD))
    trace = []
    for k in range(first, last + 1):
        x, y = batch(k, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if k == checkpoint_at:
            opt.before_checkpoint()
        trace.append((flat(model), opt.metrics()))
    return model, opt, trace


def _restart(strategy, opt_kind: str, rank: int) -> dict:
    """Continuous run vs. save at step 5 (mid-schedule), rebuild from another seed, load, go on."""
    model, opt, _ = _train(strategy, opt_kind, rank, 1, 5)
    opt.before_checkpoint()  # what torchrelay.train's checkpoint does first
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    model, opt, straight_rest = _train(strategy, opt_kind, rank, 6, STEPS, model, opt)
    fresh = make_model(seed=123)
    fresh_opt = make_optimizer(opt_kind, fresh.parameters())
    fresh, fresh_opt = sync.prepare(fresh, fresh_opt, strategy, Ctx(rank, WORLD))
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["optimizer"])
    _, _, resumed = _train(strategy, opt_kind, rank, 6, STEPS, fresh, fresh_opt)
    return {"straight": [f for f, _ in straight_rest], "resumed": [f for f, _ in resumed]}


def _accuracy(strategy, rank: int, steps: int = 240) -> float:
    x_train, y_train, x_test, y_test = digits()
    x_mine, y_mine = x_train[rank::WORLD], y_train[rank::WORLD]
    model = make_model(seed=0, hidden=64)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, opt = sync.prepare(model, opt, strategy, Ctx(rank, WORLD))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(len(x_mine), (32,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x_mine[idx]), y_mine[idx]).backward()
        opt.step()
    sync.finish(model, opt)
    with torch.no_grad():
        return float((model(x_test).argmax(1) == y_test).float().mean())


def scenarios(rank: int) -> dict:
    out: dict = {"traces": {}, "restart": {}, "accuracy": {}, "finish": {}}
    for name, opt_kind in TRACES:
        checkpoint_at = CHECKPOINT_AT if name == "final_average" else None
        model, opt, trace = _train(STRATEGIES[name], opt_kind, rank, 1, STEPS, checkpoint_at=checkpoint_at)
        out["traces"][name] = trace
        if name == "final_average":
            sync.finish(model, opt)
            after_first = (flat(model), opt.metrics())
            sync.finish(model, opt)
            out["finish"] = {"first": after_first, "second": (flat(model), opt.metrics())}
        del model, opt
    for name, opt_kind in [("local_sgd_h3_w2", "sgd"), ("diloco_h3", "adam"), ("final_average", "adam")]:
        out["restart"][name] = _restart(STRATEGIES[name], opt_kind, rank)
    for name, strategy in [("ddp", DDPStrategy()), ("local_sgd", LocalSGDStrategy(kind="local_sgd", every=8)),
                           ("diloco", DiLoCoStrategy(kind="diloco", every=8)),
                           ("final_average", FinalAverageStrategy(kind="final_average"))]:
        out["accuracy"][name] = _accuracy(strategy, rank)
    return out


def _entry(rank: int, port: int, outdir: str, data: tuple[torch.Tensor, ...]) -> None:
    global _DIGITS
    _DIGITS = data  # loaded once by the parent: importing sklearn in each rank costs seconds
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = scenarios(rank)
        torch.save(result, Path(outdir) / f"rank{rank}.pt")
    finally:
        gc.collect()  # DDP's reducer sits in a reference cycle: see docs/design.md, exit-time abort
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(outdir: Path, deadline_s: float = 150) -> list[dict]:
    ctx = mp.start_processes(_entry, args=(free_port(), str(outdir), digits()), nprocs=WORLD, join=False,
                             daemon=True, start_method="spawn")
    try:
        end = time.monotonic() + deadline_s
        while not ctx.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() > end:
                raise TimeoutError(f"two-rank sync scenarios did not finish in {deadline_s}s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join()
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_two_ranks(tmp_path_factory.mktemp("sync"))


# ---------------------------------------------------------------- single-process references


def simulate_ddp(steps: int = STEPS) -> list[torch.Tensor]:
    """One process on the whole (2 × PER_RANK) batch."""
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    out = []
    for k in range(1, steps + 1):
        xs, ys = zip(*(batch(k, r) for r in range(WORLD)))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        out.append(flat(model))
    return out


def simulate_replicas(opt_kind: str, *, every: int | None, warmup: int = 0, outer: tuple[float, float] | None = None,
                      average_at: tuple[int, ...] = (), steps: int = STEPS):
    """Two replicas in one process. Returns per-step [(rank0 flat, rank1 flat, divergence or None)]."""
    replicas = [make_model() for _ in range(WORLD)]
    opts = [make_optimizer(opt_kind, m.parameters()) for m in replicas]
    params = [list(m.parameters()) for m in replicas]
    global_params = [p.detach().clone() for p in params[0]]
    momentum = [torch.zeros_like(p) for p in global_params]
    out = []
    for k in range(1, steps + 1):
        for r, (m, o) in enumerate(zip(replicas, opts)):
            x, y = batch(k, r)
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
        if k <= warmup:
            for group in zip(*params):
                mean = sum(p.grad for p in group) / WORLD
                for p in group:
                    p.grad = mean.clone()
        for o in opts:
            o.step()
        divergence = None
        sync_now = (every is not None and k > warmup and (k - warmup) % every == 0) or k in average_at
        if sync_now:
            with torch.no_grad():
                means = [sum(p.detach() for p in group) / WORLD for group in zip(*params)]
                diff = sum(float(((params[0][i] - mean) ** 2).sum()) for i, mean in enumerate(means))
                norm = sum(float((mean ** 2).sum()) for mean in means)
                divergence = (diff ** 0.5) / (norm ** 0.5)
                if outer is None:
                    new = means
                else:  # hand-written Nesterov SGD, as torch.optim.SGD(nesterov=True) defines it
                    lr, mu = outer
                    new = []
                    for i, mean in enumerate(means):
                        grad = global_params[i] - mean
                        momentum[i] = mu * momentum[i] + grad if k > every else grad.clone()
                        update = grad + mu * momentum[i] if mu else grad
                        global_params[i] = global_params[i] - lr * update
                        new.append(global_params[i].clone())
                for group, value in zip(zip(*params), new):
                    for p in group:
                        p.copy_(value)
        out.append((flat(replicas[0]), flat(replicas[1]), divergence))
    return out


def assert_trace_matches(trace_by_rank, simulated, atol=1e-5):
    for k, sim in enumerate(simulated, start=1):
        for r in range(WORLD):
            got = trace_by_rank[r][k - 1][0]
            assert torch.allclose(got, sim[r], atol=atol), f"step {k} rank {r}: max |diff| {float((got - sim[r]).abs().max())}"
            expected_div = sim[2]
            metrics = trace_by_rank[r][k - 1][1]
            if expected_div is None:
                assert "divergence" not in metrics, f"step {k}: divergence reported off a sync point"
            else:
                assert metrics["divergence"] == pytest.approx(expected_div, rel=1e-3, abs=1e-7), f"step {k} rank {r}"


def _traces(ranks, name):
    return [ranks[r]["traces"][name] for r in range(WORLD)]


# ---------------------------------------------------------------- tests


def test_ddp_equals_one_process_on_the_whole_batch(ranks):
    sim = simulate_ddp()
    for r in range(WORLD):
        for k, (got, _) in enumerate(_traces(ranks, "ddp")[r]):
            assert torch.allclose(got, sim[k], atol=1e-5), f"step {k + 1} rank {r}"


def test_local_sgd_every_step_equals_ddp(ranks):
    ddp, local = _traces(ranks, "ddp"), _traces(ranks, "local_sgd_h1")
    for r in range(WORLD):
        for k in range(STEPS):
            assert torch.allclose(local[r][k][0], ddp[r][k][0], atol=1e-5), f"step {k + 1} rank {r}"


@pytest.mark.parametrize("name, opt_kind, kwargs", [
    ("local_sgd_h3", "sgd", dict(every=3)),
    ("local_sgd_h3_w2", "sgd", dict(every=3, warmup=2)),
    ("diloco_plain_h3", "sgd", dict(every=3, outer=(1.0, 0.0))),
    ("diloco_h3", "adam", dict(every=3, outer=(0.7, 0.9))),
    ("final_average", "sgd", dict(every=None, average_at=(CHECKPOINT_AT,))),
])
def test_strategy_matches_single_process_replicas(ranks, name, opt_kind, kwargs):
    assert_trace_matches(_traces(ranks, name), simulate_replicas(opt_kind, **kwargs))


def test_replicas_identical_after_every_sync_point(ranks):
    syncs = {"local_sgd_h3": {3, 6, 9}, "local_sgd_h3_w2": {1, 2, 5, 8}, "diloco_h3": {3, 6, 9},
             "diloco_plain_h3": {3, 6, 9}, "final_average": {CHECKPOINT_AT}, "ddp": set(range(1, STEPS + 1))}
    for name, at in syncs.items():
        trace = _traces(ranks, name)
        for k in range(1, STEPS + 1):
            same = torch.equal(trace[0][k - 1][0], trace[1][k - 1][0])
            if k in at:
                assert same, f"{name}: replicas differ right after sync step {k}"
            elif name != "ddp" and k not in at and k > 1:
                assert not same, f"{name}: replicas equal at step {k}, where they train apart"


def test_diloco_with_unit_outer_lr_and_no_momentum_equals_local_sgd(ranks):
    local, diloco = _traces(ranks, "local_sgd_h3"), _traces(ranks, "diloco_plain_h3")
    for r in range(WORLD):
        for k in range(STEPS):
            assert torch.allclose(diloco[r][k][0], local[r][k][0], atol=1e-5), f"step {k + 1} rank {r}"


def test_bytes_per_step_match_model_size_and_schedule(ranks):
    size = param_bytes(make_model())
    expected = {
        "ddp": [size] * STEPS,
        "local_sgd_h1": [size] * STEPS,
        "local_sgd_h3": [size if k % 3 == 0 else 0 for k in range(1, STEPS + 1)],
        "local_sgd_h3_w2": [size if k <= 2 or (k - 2) % 3 == 0 else 0 for k in range(1, STEPS + 1)],
        "diloco_h3": [size if k % 3 == 0 else 0 for k in range(1, STEPS + 1)],
        # the checkpoint average after step 4 is counted in the step that follows it
        "final_average": [size if k == CHECKPOINT_AT + 1 else 0 for k in range(1, STEPS + 1)],
    }
    for name, want in expected.items():
        for r in range(WORLD):
            got = [int(m["bytes_sent"]) for _, m in _traces(ranks, name)[r]]
            assert got == want, f"{name} rank {r}"
            assert _traces(ranks, name)[r][-1][1]["bytes_sent_total"] == sum(want)


def test_final_average_finish_averages_once_and_is_idempotent(ranks):
    size = param_bytes(make_model())
    first = [ranks[r]["finish"]["first"] for r in range(WORLD)]
    second = [ranks[r]["finish"]["second"] for r in range(WORLD)]
    assert torch.equal(first[0][0], first[1][0]), "replicas differ after finish()"
    sim = simulate_replicas("sgd", every=None, average_at=(CHECKPOINT_AT, STEPS))
    assert torch.allclose(first[0][0], sim[-1][0], atol=1e-5)
    assert first[0][1]["divergence"] == pytest.approx(sim[-1][2], rel=1e-3)
    for r in range(WORLD):
        assert first[r][1]["bytes_sent_total"] == 2 * size
        assert second[r][1]["bytes_sent_total"] == 2 * size, "second finish() communicated again"
        assert torch.equal(first[r][0], second[r][0])


@pytest.mark.parametrize("name", ["local_sgd_h3_w2", "diloco_h3", "final_average"])
def test_restart_mid_schedule_continues_exactly(ranks, name):
    for r in range(WORLD):
        run = ranks[r]["restart"][name]
        for k, (a, b) in enumerate(zip(run["straight"], run["resumed"]), start=6):
            assert torch.equal(a, b), f"{name} rank {r}: resumed run differs at step {k}"


@pytest.mark.parametrize("name", ["ddp", "local_sgd", "diloco", "final_average"])
def test_each_strategy_trains_digits(ranks, name):
    accuracies = [ranks[r]["accuracy"][name] for r in range(WORLD)]
    assert accuracies[0] == accuracies[1], "ranks disagree on the final model"
    assert accuracies[0] >= 0.95, f"{name}: test accuracy {accuracies[0]:.3f} < 0.95"
