"""Balanced data parallel on two real gloo ranks, checked against one process on the whole batch.

This file is also its own worker script (``tests/rank_scripts.py``): one two-rank launch runs
every scenario and writes what each rank saw; the tests compare it with single-process math.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

GLOBAL_BATCH = 64
SPLITS = [(63, 1), (43, 21), (32, 32)]  # a share of one sample, uneven, even


def data():
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    return (torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order], dtype=torch.long))


def make_model(seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def whole_batch_gradient(x, y):
    import torch.nn.functional as F

    model = make_model()
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------- in the ranks


def _fresh(strategy):
    """A new balanced prepare (the session's balancer dropped first)."""
    import torch

    from torchrelay.train import sync
    from torchrelay.train.session import current_session

    current_session().balancer = None
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return sync.prepare(model, optimizer, strategy, _Ctx())


class _Ctx:
    def __init__(self):
        import torch.distributed as dist

        self.rank, self.world_size, self.device = dist.get_rank(), dist.get_world_size(), "cpu"


def scenario_gradients(rank: int, x, y) -> dict:
    """DDP's weighted all-reduce for each split: the largest difference from the whole batch's."""
    import torch.nn.functional as F

    from torchrelay.spec import DDPStrategy

    out = {}
    for split in SPLITS:
        model, optimizer = _fresh(DDPStrategy(balance="throughput", balance_threshold=0.99))
        balancer = optimizer.balancer
        balancer.set_global_batch(GLOBAL_BATCH)
        balancer.shares = split
        start = sum(split[:rank])
        balancer.on_batch(split[rank], GLOBAL_BATCH)
        xs, ys = x[start:start + split[rank]], y[start:start + split[rank]]
        F.cross_entropy(model(xs), ys).backward()
        reference = whole_batch_gradient(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH])
        out[str(split)] = max(float((p.grad - r).abs().max()) for p, r in zip(model.parameters(), reference))
    return out


def scenario_coverage(rank: int, x, y) -> dict:
    """The loader's indices over an epoch with a re-split after step 5 (1797 = 28 x 64 + 5)."""
    import torch
    from torch.utils.data import TensorDataset

    from torchrelay.spec import DDPStrategy
    from torchrelay.train.balance import BalancedLoader

    _, optimizer = _fresh(DDPStrategy(balance="throughput"))
    balancer = optimizer.balancer
    loader = BalancedLoader(TensorDataset(torch.arange(len(x))), batch_size=GLOBAL_BATCH // 2, balancer=balancer,
                            seed=3)
    loader.set_epoch(1)
    seen, sizes = [], []
    for step, (idx,) in enumerate(loader):
        seen += idx.tolist()
        sizes.append(len(idx))
        if step == 5:
            balancer.shares = (50, 14)
    return {"seen": seen, "sizes": sizes, "steps": len(loader)}


def scenario_calibration(rank: int, calibrated: float = 57.0, after: float = 50.0, steps: int = 43,
                         rank1_speed=None) -> list:
    """The balancer's shares after each of ``steps`` steps, over real collectives, with compute
    times that say rank 0 trains 100 samples/s and rank 1 ``calibrated`` in the calibration
    steps, ``after`` later (or ``rank1_speed(step)``)."""
    from torchrelay.train.balance import Balancer, StepTimes

    balancer = Balancer(rank=rank, world=2, every=20, threshold=0.1)
    balancer.set_global_batch(GLOBAL_BATCH)
    history = []
    for step in range(1, steps + 1):
        share = balancer.share
        balancer.on_batch(share, GLOBAL_BATCH)
        speed = 100.0 if rank == 0 else rank1_speed(step) if rank1_speed else (calibrated if step <= 3 else after)
        busy = share / speed
        times = None if step == 1 else StepTimes(compute_s=busy, idle_s=0.0, step_s=busy)  # the first has no start
        balancer.after_step(step, times)
        history.append(list(balancer.shares))
    return history


def scenario_prior(rank: int) -> dict:
    """The first split from the ranks' CPU allowances (1 and 0.5 cpu), over real collectives:
    agreed after the loader set the global batch or before it; even when a rank is not on the
    CPU (0); never over shares loaded from a checkpoint or kept by a calibration."""
    from torchrelay.train.balance import Balancer, StepTimes

    def fresh() -> Balancer:
        return Balancer(rank=rank, world=2, every=20, threshold=0.1)

    allowance = 1.0 if rank == 0 else 0.5
    out = {}
    b = fresh()
    b.set_global_batch(GLOBAL_BATCH)
    out["weights"] = b.agree_prior(allowance)
    out["after_loader"] = list(b.shares)
    b = fresh()
    b.agree_prior(allowance)
    b.set_global_batch(GLOBAL_BATCH)
    out["before_loader"] = list(b.shares)
    b = fresh()
    b.set_global_batch(GLOBAL_BATCH)
    out["gpu_weights"] = b.agree_prior(0.0 if rank == 1 else 1.0)
    out["gpu"] = list(b.shares)
    b = fresh()
    b.set_global_batch(GLOBAL_BATCH)
    b.load_state_dict({"shares": [40, 24], "global_batch": GLOBAL_BATCH, "resplits": 1})
    b.agree_prior(allowance)
    out["loaded"] = list(b.shares)
    b = fresh()  # calibration at the prior's split, on speeds of 100 and 53 samples/s: kept
    b.set_global_batch(GLOBAL_BATCH)
    b.agree_prior(allowance)
    for step in range(1, 4):
        b.on_batch(b.share, GLOBAL_BATCH)
        busy = b.share / (100.0 if rank == 0 else 53.0)
        b.after_step(step, None if step == 1 else StepTimes(compute_s=busy, idle_s=0.0, step_s=busy))
    out["calibrated"] = [list(b.shares), b.resplits]
    b.agree_prior(1.0)  # a later agreement leaves measured shares alone
    out["agreed_again"] = list(b.shares)
    b = fresh()  # calibration on speeds of 100 and 62: 40 + 24 gains 7 %, under the threshold, over half
    b.set_global_batch(GLOBAL_BATCH)
    b.agree_prior(allowance)
    history = []
    for step in range(1, 24):
        b.on_batch(b.share, GLOBAL_BATCH)
        busy = b.share / (100.0 if rank == 0 else 62.0)
        b.after_step(step, None if step == 1 else StepTimes(compute_s=busy, idle_s=0.0, step_s=busy))
        history.append(list(b.shares))
    out["guess_off"] = [history[2], history[-1], b.resplits]
    b = fresh()  # equal allowances, speeds of 100 and 85: 35 + 29 gains 7 %, which calibration never took
    b.set_global_batch(GLOBAL_BATCH)
    b.agree_prior(1.0)
    for step in range(1, 4):
        b.on_batch(b.share, GLOBAL_BATCH)
        busy = b.share / (100.0 if rank == 0 else 85.0)
        b.after_step(step, None if step == 1 else StepTimes(compute_s=busy, idle_s=0.0, step_s=busy))
    out["equal"] = [list(b.shares), b.resplits]
    b = fresh()  # the guess kept at calibration (100 and 53), then rank 1 at 40: the window to step 13 moves it
    b.set_global_batch(GLOBAL_BATCH)
    b.agree_prior(allowance)
    history = []
    for step in range(1, 14):
        b.on_batch(b.share, GLOBAL_BATCH)
        busy = b.share / (100.0 if rank == 0 else 53.0 if step <= 3 else 40.0)
        b.after_step(step, None if step == 1 else StepTimes(compute_s=busy, idle_s=0.0, step_s=busy))
        history.append(list(b.shares))
    out["half_window"] = [history[2], history[11], history[12]]
    return out


def scenario_local_sgd(rank: int, x, y, kind: str = "local_sgd") -> list:
    """Local SGD every 2 steps on shares (43, 21) (or DiLoCo with outer lr 1 and no momentum,
    which is the same): the parameters after 4 steps."""
    import torch.nn.functional as F

    from torchrelay.spec import DiLoCoStrategy, LocalSGDStrategy

    if kind == "local_sgd":
        strategy = LocalSGDStrategy(kind="local_sgd", every=2, balance="throughput", balance_threshold=0.99)
    else:
        strategy = DiLoCoStrategy(kind="diloco", every=2, outer_lr=1.0, outer_momentum=0.0, balance="throughput",
                                  balance_threshold=0.99)
    model, optimizer = _fresh(strategy)
    balancer = optimizer.balancer
    balancer.set_global_batch(GLOBAL_BATCH)
    balancer.shares = (43, 21)
    start = sum(balancer.shares[:rank])
    for step in range(4):
        base = step * GLOBAL_BATCH + start
        share = balancer.shares[rank]
        balancer.on_batch(share, GLOBAL_BATCH)
        optimizer.zero_grad()
        F.cross_entropy(model(x[base:base + share]), y[base:base + share]).backward()
        optimizer.step()
    assert balancer.shares == (43, 21)
    return [p.detach().tolist() for p in model.parameters()]


def scenario_resume(rank: int, x, y, out_dir: str) -> dict:
    """DDP balanced through TrainState: 30 steps at once, and 17 + a restore + 13."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import torchrelay.train as rt
    from torchrelay.train import shard
    from torchrelay.train.checkpoint_state import TrainState
    from torchrelay.train.session import current_session

    shares = {}

    def run(steps: int, restore: bool) -> list:
        current_session().balancer = None
        model = make_model()
        model, optimizer = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        loader = shard(TensorDataset(x, y), batch_size=GLOBAL_BATCH // 2, seed=5)
        state = TrainState(model, optimizer, loader)
        if restore:
            assert state.restore()
            shares["restored"] = list(current_session().balancer.shares)
        for _ in state.epochs(2):
            for xs, ys in state.batches():
                optimizer.zero_grad()
                F.cross_entropy(model(xs), ys).backward()
                optimizer.step()
                if state.step == 17 and not restore:
                    current_session().balancer.shares = (40, 24)  # as a re-split would have left them
                    shares["saved"] = [40, 24]
                    state.save()
                if state.step == 30:
                    return [p.detach().clone() for p in model.parameters()]
        raise AssertionError("the epochs ended early")

    straight = run(30, restore=False)  # saves at step 17 on the way
    resumed = run(30, restore=True)
    return {"max_diff": max(float((a - b).abs().max()) for a, b in zip(straight, resumed)), "shares": shares,
            "metrics": {k: v for k, v in current_session().hooks.metrics().items()}}


def scenario_idle(rank: int, x, y) -> dict:
    """Plain DDP and local SGD (no balancing): rank 1 spends 100 ms more per step before its
    backward (asleep: a spin would take one of this machine's two cores from the rank that is
    measuring its wait); each rank's idle seconds in the all-reduce over 8 steps (after the first)."""
    import time

    import torch.nn.functional as F

    from torchrelay.spec import DDPStrategy, LocalSGDStrategy

    out = {}
    for name, strategy in (("ddp", DDPStrategy()), ("local_sgd", LocalSGDStrategy(kind="local_sgd", every=1))):
        model, optimizer = _fresh(strategy)
        idle, fractions = 0.0, []
        for step in range(9):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[:32]), y[:32])
            if rank == 1:
                time.sleep(0.1)
            loss.backward()
            optimizer.step()
            metrics = optimizer.metrics()
            if step:
                idle += metrics["allreduce_wait_s"]
                fractions.append(metrics["idle_fraction"])
        out[name] = {"idle_s": idle, "fractions": fractions}
    return out


def main(scenario: str, rank: int, world: int, port: int, out_dir: str) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), RELAY_OUTPUT_DIR=str(Path(out_dir) / "outputs"),
                      RELAY_STRATEGY=json.dumps({"kind": "ddp", "balance": "throughput"}))
    torch.set_num_threads(1)
    import torchrelay.train as rt

    rt.init()
    x, y = data()
    try:
        result = {"gradients": scenario_gradients(rank, x, y), "coverage": scenario_coverage(rank, x, y),
                  "local_sgd": scenario_local_sgd(rank, x, y), "diloco": scenario_local_sgd(rank, x, y, "diloco"),
                  "idle": scenario_idle(rank, x, y), "calibration": scenario_calibration(rank),
                  "fine": scenario_calibration(rank, calibrated=33.0, after=40.0, steps=103),
                  "carried_on": scenario_calibration(rank, calibrated=42.0, after=40.0, steps=43),
                  "refined_after_change": scenario_calibration(rank, steps=143, rank1_speed=lambda s: (
                      40.0 if s <= 33 else 30.0 if s <= 43 else 26.0)),
                  "fine_after_change": scenario_calibration(rank, steps=143, rank1_speed=lambda s: (
                      40.0 if s <= 33 else 23.0 if s <= 43 else 34.0)),
                  "resume": scenario_resume(rank, x, y, out_dir), "prior": scenario_prior(rank)}
        if rank == 0:
            result["reference"] = local_sgd_reference(x, y)
        (Path(out_dir) / f"{scenario}-{rank}.json").write_text(json.dumps(result))
    finally:
        rt.shutdown()


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rank_scripts import run_ranks

    return run_ranks(__file__, tmp_path_factory.mktemp("balanced"), 2, "all")


@pytest.mark.parametrize("split", [str(s) for s in SPLITS])
def test_weighted_split_gradient_equals_the_whole_batch(ranks, split):
    for rank in ranks:
        assert rank["gradients"][split] < 1e-6


def test_the_window_after_calibration_refines_a_split_that_gains_under_the_threshold(ranks):
    # calibrated on 57 samples/s, rank 1 trains 50: 41 + 23 predicts a step 6.5 % slower than
    # 43 + 21, under the 10 % threshold, so only the refinement in the next (half) window moves it
    for rank in ranks:
        history = rank["calibration"]
        assert history[2] == [41, 23] and history[11] == [41, 23]
        assert history[12] == [43, 21] and history[-1] == [43, 21]  # half a window later


def test_a_refinement_carries_a_move_on_by_a_quarter_of_the_threshold(ranks):
    # calibrated on 42 samples/s, rank 1 trains 40: 45 + 19 predicts a step 3.2 % slower than
    # 46 + 18, under half the threshold, over a quarter, and carrying calibration's move on
    for rank in ranks:
        history = rank["carried_on"]
        assert history[2] == [45, 19] and history[11] == [45, 19]
        assert history[12] == [46, 18] and history[-1] == [46, 18]


def test_speeds_steady_for_three_windows_move_a_split_once_by_a_quarter_of_the_threshold(ranks):
    # calibrated on 33 samples/s, rank 1 trains 40: 48 + 16, past 46 + 18, predicts a step 4.2 %
    # slower: under the refinement's 5 %, and back the way calibration moved. The fine move comes
    # once three windows at 48 + 16 agree (steps 13, the refining half window, 33 and 53), and no
    # move follows it
    for rank in ranks:
        history = rank["fine"]
        assert history[2] == [48, 16] and history[51] == [48, 16]
        assert history[52] == [46, 18] and history[-1] == [46, 18]


def test_the_window_after_a_move_refines_it_once(ranks):
    # rank 1 trains 40 (calibrated 46 + 18), slows to 30 at step 34 and 26 at 44: the window of
    # step 53 (28 on average) moves the shares to 50 + 14; the next one, half a window, measures
    # 26, and 51 + 13 predicts a step 5.3 % faster, over the refinement's half threshold; nothing
    # moves them after
    for rank in ranks:
        history = rank["refined_after_change"]
        assert history[51] == [46, 18] and history[52] == [50, 14] and history[61] == [50, 14]
        assert history[62] == [51, 13] and history[-1] == [51, 13]
        assert len({tuple(h) for h in history}) == 4  # 32 + 32, 46 + 18, 50 + 14, 51 + 13


def test_no_fine_move_once_a_worker_changed_speed(ranks):
    # rank 1 slows to 23 at step 34 and comes back to 34 at 44: the window of step 53 moves the
    # shares to 50 + 14, and though 48 + 16 fits 34 by 4 % (over a fine move's 2.5 %, under the
    # refinement's 5 %, and back the way the move went), nothing moves them after
    for rank in ranks:
        history = rank["fine_after_change"]
        assert history[52] == [50, 14] and history[-1] == [50, 14]
        assert len({tuple(h) for h in history}) == 3  # 32 + 32, 46 + 18, 50 + 14


def test_the_first_split_follows_the_ranks_cpu_allowances(ranks):
    for rank in ranks:
        prior = rank["prior"]
        assert prior["weights"] == [1.0, 0.5]
        assert prior["after_loader"] == prior["before_loader"] == [43, 21]
        assert prior["gpu_weights"] is None and prior["gpu"] == [32, 32]  # a rank not on the CPU: even
        assert prior["loaded"] == [40, 24]  # a checkpoint's shares win
        assert prior["calibrated"] == [[43, 21], 0]  # 42 + 22 would gain 2 %: under the threshold
        assert prior["agreed_again"] == [43, 21]
        # a guess off by less than the threshold's gain is refined at calibration, not kept for good
        assert prior["guess_off"] == [[40, 24], [40, 24], 1]
        # equal allowances: the even split, compared at calibration as it always was
        assert prior["equal"] == [[32, 32], 0]
        # a guess kept at calibration is measured again over the next half window (K/2), which
        # moves it as a refinement: 46 + 18 gains 12 %, a move a plain comparison would hold for a second window
        assert prior["half_window"] == [[43, 21], [43, 21], [46, 18]]


def test_every_sample_once_per_epoch_across_a_resplit(ranks):
    seen = [r["coverage"]["seen"] for r in ranks]
    assert sorted(seen[0] + seen[1]) == list(range(1797))
    assert ranks[0]["coverage"]["steps"] == ranks[1]["coverage"]["steps"] == 29  # 28 x 64, then 5
    sizes = [r["coverage"]["sizes"] for r in ranks]
    assert sizes[0][:6] == [32] * 6 and sizes[0][6] == 50 and sizes[1][6] == 14
    assert (sizes[0][-1], sizes[1][-1]) == (4, 1)  # the 5 left, in proportion to (50, 14)


def local_sgd_reference(x, y) -> list:
    """Two replicas in one process on shares (43, 21), averaged every 2 steps by samples."""
    import torch
    import torch.nn.functional as F

    replicas = [make_model(), make_model()]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in replicas]
    shares, starts = (43, 21), (0, 43)
    for step in range(4):
        for model, opt, share, start in zip(replicas, optimizers, shares, starts):
            base = step * GLOBAL_BATCH + start
            opt.zero_grad()
            F.cross_entropy(model(x[base:base + share]), y[base:base + share]).backward()
            opt.step()
        if step % 2 == 1:
            with torch.no_grad():
                for a, b in zip(*(m.parameters() for m in replicas)):
                    mean = (a * 43 * 2 + b * 21 * 2) / (64 * 2)
                    a.copy_(mean)
                    b.copy_(mean)
    return [p.detach().tolist() for p in replicas[0].parameters()]


@pytest.mark.parametrize("kind", ["local_sgd", "diloco"])
def test_balanced_local_sgd_and_diloco_average_by_samples(ranks, kind):
    import torch

    expected = ranks[0]["reference"]  # computed by rank 0 alone, in one process
    for rank in ranks:
        for got, want in zip(rank[kind], expected):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6)


def test_kill_and_resume_mid_epoch_gives_the_same_parameters(ranks):
    for rank in ranks:
        assert rank["resume"]["max_diff"] < 1e-5
        assert rank["resume"]["shares"]["restored"] == rank["resume"]["shares"]["saved"]  # the split came back


@pytest.mark.parametrize("strategy", ["ddp", "local_sgd"])
def test_idle_time_in_the_allreduce_is_reported_for_plain_data_parallel(ranks, strategy):
    """The rank that waits for a slower peer reports the wait: about 100 ms a step over 8 steps."""
    fast, slow = (r["idle"][strategy] for r in ranks)
    assert fast["idle_s"] > slow["idle_s"] + 8 * 0.05, (fast, slow)
    assert all(0.0 <= f <= 1.0 for f in fast["fractions"] + slow["fractions"])


def test_the_step_reports_share_and_idle(ranks):
    for number, rank in enumerate(ranks):
        metrics = rank["resume"]["metrics"]
        assert 0.0 <= metrics["idle_fraction"] <= 1.0 and metrics["compute_s"] > 0
        assert metrics["share"] >= 1 and metrics["measured_samples_per_s"] > 0


@pytest.mark.slow  # a cluster, two torchruns and an epoch: about 40 s on a quiet machine, 2 min at load 10
def test_a_balanced_job_through_the_platform(cluster_factory):
    """The digits example, unchanged, under balance: throughput on two agents: it succeeds, and
    the job's summary holds each rank's share (summing to the global batch) and idle time."""
    from torchrelay.client.cli.jobs import rank_lines
    from torchrelay.client.sdk import RelayClient
    from torchrelay.spec import JobSpec, JobState

    digits = Path(__file__).resolve().parents[2] / "examples" / "digits"
    cluster = cluster_factory(2)
    with RelayClient(cluster.address) as client:
        spec = JobSpec.parse({"name": "digits-balanced", "entrypoint": "python train.py --epochs 1 --batch-size 32",
                              "nodes": 2, "workers_per_node": 1, "resources": {"cpu": 1, "memory": "1GiB"},
                              "strategy": {"kind": "ddp", "balance": "throughput", "balance_every": 5}})
        final = client.wait(client.submit(spec, base_dir=digits).id, timeout=180)
    assert final.state == JobState.SUCCEEDED, final.failure
    ranks = final.last_metrics["ranks"]
    assert sorted(ranks) == ["0", "1"]
    assert ranks["0"]["share"] + ranks["1"]["share"] == 64
    assert all(0.0 <= r["idle_fraction"] <= 1.0 and r["measured_samples_per_s"] > 0 for r in ranks.values())
    assert [line.split(":")[0] for line in rank_lines(ranks)] == ["rank 0", "rank 1"]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
