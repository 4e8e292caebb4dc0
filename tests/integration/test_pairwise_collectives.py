"""The pairwise exchanges on real gloo ranks: FSDP2's all-gather and reduce-scatter and DDP's two-rank
all-reduce give gloo's results, gloo's own run where they do not apply, and training is the same with
them as without.

This file is also the worker script (``python test_pairwise_collectives.py SCENARIO RANK WORLD PORT
OUT_DIR``, run by ``tests/rank_scripts.run_ranks``); each rank writes ``OUT_DIR/SCENARIO-RANK.json``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(300)

PIECE = 1000  # elements of each rank's piece


def _filled(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def scenario_all_gather(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from torchrelay.train.sharded.pairwise import PairwiseAllGather

    group, out = dist.group.WORLD, {}
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.empty(world * PIECE, dtype=dtype)
        dist.all_gather_into_tensor(expected, _filled(rank, PIECE, dtype))
        apart = torch.full((world * PIECE,), float("nan"), dtype=dtype)
        PairwiseAllGather()(apart, _filled(rank, PIECE, dtype), group)
        in_place = torch.full((world * PIECE,), float("nan"), dtype=dtype)  # as FSDP2 calls it
        piece = in_place.view(world, PIECE)[rank]
        piece.copy_(_filled(rank, PIECE, dtype))
        PairwiseAllGather()(in_place, piece, group)
        out[str(dtype)] = {"apart": torch.equal(apart, expected), "in_place": torch.equal(in_place, expected)}
    later = torch.empty(world * PIECE)
    work = PairwiseAllGather()(later, _filled(rank, PIECE), group, async_op=True)  # gloo's own, asynchronous
    work.wait()
    expected = torch.empty(world * PIECE)
    dist.all_gather_into_tensor(expected, _filled(rank, PIECE))
    out["async"] = torch.equal(later, expected)
    return out


def scenario_reduce_scatter(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from torchrelay.train.sharded.pairwise import PairwiseReduceScatter

    group, out = dist.group.WORLD, {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("max", dist.ReduceOp.MAX)):
        data = _filled(rank, world * PIECE)
        expected = torch.empty(PIECE)
        dist.reduce_scatter_tensor(expected, data.clone(), op=op)
        got = torch.full((PIECE,), float("nan"))
        PairwiseReduceScatter()(got, data, group, op)
        out[name] = {"diff": (got - expected).abs().max().item(),
                     "input_kept": torch.equal(data, _filled(rank, world * PIECE))}
    return out


def _trained_both_ways(widths: list[int], prepare, full, rank: int, world: int) -> dict:  # noqa: ANN001
    """Three steps of a Tanh MLP of ``widths`` with ``RELAY_PAIRWISE=1``, then ``=0``, from the same
    start: the largest difference between the two runs' parameters (``full`` makes one whole) and how
    far the first layer moved."""
    from torchrelay.train import unwrap

    finals = {}
    for pairwise in ("1", "0"):
        os.environ["RELAY_PAIRWISE"] = pairwise
        torch.manual_seed(0)
        layers = [layer for a, b in zip(widths, widths[1:]) for layer in (nn.Linear(a, b), nn.Tanh())][:-1]
        model = nn.Sequential(*layers)
        model, opt = prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
        for step in range(3):
            g = torch.Generator().manual_seed(step * world + rank)
            loss = nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g))
            loss.backward()
            opt.step()
            opt.zero_grad()
        finals[pairwise] = {k: full(v) for k, v in unwrap(model).state_dict().items()}
    os.environ.pop("RELAY_PAIRWISE")
    torch.manual_seed(0)
    first = nn.Linear(16, widths[1]).weight.detach()
    return {"diff": max((finals["1"][k] - finals["0"][k]).abs().max().item() for k in finals["1"]),
            "moved": (finals["1"]["0.weight"] - first).abs().max().item(),
            "weight": finals["1"]["0.weight"].flatten()[:8].tolist()}


def scenario_training(rank: int, world: int) -> dict:
    """Three fsdp steps with the pairwise collectives and three with gloo's own, from the same start."""
    from torchrelay.spec import FSDPStrategy
    from torchrelay.train import sharded
    from torchrelay.train.sharded import pairwise as module

    calls = {"1": 0, "0": 0}
    for cls in (module.PairwiseAllGather, module.PairwiseReduceScatter):  # count the calls FSDP2 makes
        def counted(self, *args, _original=cls.__call__, **kwargs):  # noqa: ANN001, ANN002, ANN003
            calls[os.environ["RELAY_PAIRWISE"]] += 1
            return _original(self, *args, **kwargs)
        cls.__call__ = counted
    out = _trained_both_ways([16, 64, 64, 4], lambda m, o: sharded.prepare(m, o, FSDPStrategy(kind="fsdp"), _context()),
                             lambda v: v.full_tensor(), rank, world)
    return {**out, "calls": calls, "agreement": _agreement(rank)}


def _agreement(rank: int) -> dict:
    """``exchange.agreed`` on this rank when every rank is willing, when rank 1 is on a GPU, and when rank 0
    alone has ``RELAY_PAIRWISE=0``: the exchanges only where every rank takes them."""
    from torchrelay.train import exchange

    out = {"all": exchange.agreed(True), "rank_1_on_gpu": exchange.agreed(on_cpu=rank != 1)}
    if rank == 0:
        os.environ["RELAY_PAIRWISE"] = "0"
    out["rank_0_off"] = exchange.agreed(True)
    os.environ.pop("RELAY_PAIRWISE", None)
    return out


def scenario_ddp(rank: int, world: int) -> dict:
    """Three ddp steps with the exchange and three with gloo's all-reduce, from the same start, plus
    ``PeerSum`` against ``all_reduce`` directly: four calls (the last two on receives posted ahead),
    a buffer of another size after a receive was posted, and a newer instance after that one."""
    import torch.distributed as dist

    from torchrelay.spec import DDPStrategy
    from torchrelay.train import exchange, sync

    out: dict = {}
    if world != 2:
        try:
            exchange.PeerSum()
        except ValueError as error:
            out["refused"] = str(error)
        return out

    def equals_all_reduce(peer_sum, seed: int, numel: int = PIECE) -> bool:
        mine = _filled(rank + seed, numel)
        expected = mine.clone()
        dist.all_reduce(expected)
        return torch.equal(peer_sum(mine), expected)

    first = exchange.PeerSum()
    out["sum_equal"] = [equals_all_reduce(first, 10 * call) for call in range(4)]
    try:
        first(torch.ones(PIECE + 1))
    except RuntimeError as error:
        out["resized"] = str(error)
    newer = exchange.PeerSum()
    out["newer_tag"] = newer.tag > first.tag
    out["newer_equal"] = [equals_all_reduce(newer, 100 + 10 * call, PIECE + 1) for call in range(3)]
    calls = {"1": 0, "0": 0}
    original = exchange.PeerSum.__call__

    def counted(self, buffer):  # noqa: ANN001, ANN202
        calls[os.environ["RELAY_PAIRWISE"]] += 1
        return original(self, buffer)

    exchange.PeerSum.__call__ = counted
    out.update(_trained_both_ways([16, 64, 4], lambda m, o: sync.prepare(m, o, DDPStrategy(), _context()),
                                  lambda v: v.detach().clone(), rank, world), calls=calls)
    exchange.PeerSum.__call__ = original
    return out


def _context():
    import torchrelay.train as rt

    return rt.current_context()


def worker(scenario: str, rank: int, world: int, port: int, out_dir: str) -> None:
    import torchrelay.train as rt

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RELAY_STRATEGY=json.dumps({"kind": "fsdp"}))
    rt.init()
    result = {"all_gather": scenario_all_gather(rank, world), "reduce_scatter": scenario_reduce_scatter(rank, world),
              "training": scenario_training(rank, world), "ddp": scenario_ddp(rank, world)}
    rt.shutdown()
    Path(out_dir, f"{scenario}-{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[int, list[dict]]:
    """{world size: each rank's results}: 2 ranks (one peer each) and 3 (two peers, an odd count)."""
    from rank_scripts import run_ranks

    out = tmp_path_factory.mktemp("pairwise")
    return {world: run_ranks(__file__, out, world, f"world{world}", timeout=240) for world in (2, 3)}


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_equals_gloos_bit_for_bit(launched: dict, world: int) -> None:
    for r in launched[world]:
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert r["all_gather"][dtype] == {"apart": True, "in_place": True}, r["all_gather"]
        assert r["all_gather"]["async"] is True  # an asynchronous call is gloo's own


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_equals_gloos_and_keeps_its_input(launched: dict, world: int) -> None:
    for r in launched[world]:
        rs = r["reduce_scatter"]
        exact = world == 2  # two addends sum alike in either order; three may round differently
        for name in ("sum", "avg"):
            assert rs[name]["diff"] <= (0.0 if exact else 1e-6), (name, rs)
        assert rs["max"]["diff"] == 0.0, rs  # not SUM or AVG: gloo's own
        assert all(rs[name]["input_kept"] for name in rs), rs


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_trains_the_same_with_the_pairwise_collectives_as_without(launched: dict, world: int) -> None:
    for r in launched[world]:
        t = r["training"]
        assert t["moved"] > 1e-3, t  # the steps changed the model: the comparison below compares something
        assert t["diff"] <= (0.0 if world == 2 else 1e-6), t
        # 3 steps × (3 units + root: forward all-gathers, backward all-gathers and reduce-scatters), the
        # last unit kept gathered; none with RELAY_PAIRWISE=0
        assert t["calls"]["1"] > 12 and t["calls"]["0"] == 0, t


@pytest.mark.parametrize("world", [2, 3])
def test_the_exchanges_are_used_only_where_every_rank_agrees(launched: dict, world: int) -> None:
    for r in launched[world]:
        agreement = r["training"]["agreement"]
        assert agreement == {"all": True, "rank_1_on_gpu": False, "rank_0_off": False}, agreement


def test_ddp_on_two_ranks_sums_by_one_exchange_and_trains_the_same(launched: dict) -> None:
    ranks = [r["ddp"] for r in launched[2]]
    for d in ranks:
        # the exchange's sum is gloo's all-reduce's, bit for bit, also on receives posted a step ahead
        assert d["sum_equal"] == [True] * 4, d
        assert "changed from 1000 torch.float32 elements to 1001" in d["resized"], d  # refused before sending
        assert d["newer_tag"] is True and d["newer_equal"] == [True] * 3, d  # the given-up receive takes nothing
        assert d["moved"] > 1e-3 and d["diff"] == 0.0, d
        assert d["calls"] == {"1": 3, "0": 0}, d  # one bucket a step, summed by the exchange; none when off
    assert ranks[0]["weight"] == ranks[1]["weight"]  # the replicas stay equal


def test_peer_sum_refuses_a_group_of_three(launched: dict) -> None:
    for r in launched[3]:
        assert "needs a group of 2 ranks, this one has 3" in r["ddp"]["refused"], r["ddp"]


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
