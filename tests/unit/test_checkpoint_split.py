"""checkpoint_replicas: the pure split/join of per-rank values, and a one-process round trip through DCP."""
from __future__ import annotations

import fractions
import functools

import pytest
import torch

from torchrelay.errors import CheckpointCorrupt, InvalidSpec
from torchrelay.storage import ArtifactStore
from torchrelay.train.checkpoint import CheckpointStore, decode_files
from torchrelay.train.checkpoint_replicas import (REPLICAS, belongs_to_other_rank, join_replicas, same_memory,
                                                  split_replicas)

pytestmark = pytest.mark.timeout(60)


def _state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7,
             "lists": [torch.ones(2), [torch.zeros(1), "x"]]}
    return model, optimizer, state


def test_split_moves_exactly_the_selected_tensors_by_reference_and_join_puts_them_back():
    model, optimizer, state = _state()
    chosen = list(model.parameters()) + [t for s in optimizer.state.values() for t in s.values()]
    chosen.append(state["lists"][1][0])
    split = split_replicas(state, same_memory(chosen), rank=1, world_size=2)
    entry = split[REPLICAS]["rank-1"]
    assert split[REPLICAS]["world_size"] == 2 and "rank-0" not in split[REPLICAS]
    by_path = {tuple(p): entry["values"][str(i)] for i, p in enumerate(entry["paths"])}
    assert set(by_path) == {("model", "0.weight"), ("model", "0.bias"), ("model", "1.weight"), ("model", "1.bias"),
                            *(("optimizer", "state", i, key) for i in range(4) for key in ("step", "exp_avg",
                                                                                            "exp_avg_sq")),
                            ("lists", 1, 0)}
    assert by_path[("model", "0.weight")].data_ptr() == model[0].weight.data_ptr()  # not copied
    assert "0.weight" not in split["model"] and split["lists"][1][0] is None  # lists keep a placeholder
    assert "state" not in split["optimizer"] or not split["optimizer"]["state"][0]
    assert split["model"]["1.running_mean"] is state["model"]["1.running_mean"]  # not chosen: shared
    assert state["model"]["0.weight"] is not None and REPLICAS not in state  # the input is unchanged
    joined = join_replicas(split, rank=1, world_size=2)
    assert REPLICAS not in joined
    assert joined["model"]["0.weight"] is by_path[("model", "0.weight")]
    assert joined["optimizer"]["state"][0]["exp_avg"] is optimizer.state[model[0].weight]["exp_avg"]
    assert joined["lists"][1][0] is state["lists"][1][0] and joined["step"] == 7


def test_join_makes_again_the_dicts_that_lost_every_value():
    """DCP keeps no empty dict: an optimizer whose whole state moved comes back keyed by int."""
    _, optimizer, state = _state()
    state = {"optimizer": optimizer.state_dict()}
    split = split_replicas(state, lambda t: True, rank=0, world_size=2)
    del split["optimizer"]["state"]  # what a DCP round trip leaves of the empty dict
    joined = join_replicas(split, rank=0, world_size=2)
    assert sorted(joined["optimizer"]["state"]) == [0, 1, 2, 3]
    assert joined["optimizer"]["state"][2]["exp_avg"] is state["optimizer"]["state"][2]["exp_avg"]


def test_split_without_a_selected_tensor_returns_the_state_itself():
    _, _, state = _state()
    assert split_replicas(state, lambda t: False, rank=0, world_size=2) is state
    assert join_replicas(state, rank=0, world_size=1) is state


@pytest.mark.parametrize("tensor, matches", [
    (lambda p: p.detach(), True),          # what state_dict() holds
    (lambda p: p, True),
    (lambda p: p.detach().clone(), False),  # a copy: another memory
    (lambda p: p.detach()[0], False),       # a view of part of it: another shape
    (lambda p: p.detach().t(), False),      # the same memory, other strides
])
def test_same_memory_recognises_views_of_the_live_tensor_only(tensor, matches):
    param = torch.nn.Parameter(torch.randn(3, 2))
    assert same_memory([param])(tensor(param)) is matches


def test_same_memory_never_matches_empty_tensors():
    empty = torch.empty(0)
    assert same_memory([empty])(empty) is False


@pytest.mark.parametrize("saved, current, error, words", [
    (2, 1, InvalidSpec, "diverged replicas of 2 ranks .* this job runs 1: resume it with 2 workers"),
    (2, 3, InvalidSpec, "of 2 ranks .* this job runs 3"),
    (4, 2, InvalidSpec, "of 4 ranks .* this job runs 2"),
])
def test_join_refuses_another_world_size(saved, current, error, words):
    state = split_replicas({"w": torch.ones(2)}, lambda t: True, rank=0, world_size=saved)
    with pytest.raises(error, match=words):
        join_replicas(state, rank=0, world_size=current, where="checkpoint X")


@pytest.mark.parametrize("damage, words", [
    (lambda s: s[REPLICAS].pop("world_size"), "no world size"),
    (lambda s: s[REPLICAS].pop("rank-0"), "entry of rank-0 is missing"),
    (lambda s: s[REPLICAS]["rank-0"]["values"].pop("0"), "missing or malformed"),
    (lambda s: s[REPLICAS]["rank-0"]["paths"].__setitem__(0, ["n", "w"]), "n.w of rank-0 has no place"),
    (lambda s: s[REPLICAS]["rank-0"]["paths"].__setitem__(0, ["l", 5]), "l.5 of rank-0 has no place"),
    (lambda s: s[REPLICAS]["rank-0"]["paths"].__setitem__(0, ["l", 0]), "l.0 of rank-0 has no place"),
    (lambda s: s.__setitem__("w", torch.zeros(2)), "w of rank-0 has no place"),
])
def test_join_reports_a_damaged_entry(damage, words):
    state = split_replicas({"w": torch.ones(2), "n": 3, "l": ["x"]}, lambda t: True, rank=0, world_size=1)
    damage(state)
    with pytest.raises(CheckpointCorrupt, match=words):
        join_replicas(state, rank=0, world_size=1)


def test_split_refuses_the_reserved_key():
    with pytest.raises(ValueError, match=REPLICAS):
        split_replicas({REPLICAS: 1}, lambda t: True, rank=0, world_size=1)


@pytest.mark.parametrize("path, rank, other", [
    ((REPLICAS, "rank-1", "values", "0"), 0, True),
    ((REPLICAS, "rank-1", "values", "0"), 1, False),
    ((REPLICAS, "world_size"), 1, False),
    (("model", "rank-1"), 0, False),
    ((REPLICAS,), 0, False),
])
def test_belongs_to_other_rank(path, rank, other):
    assert belongs_to_other_rank(path, rank) is other


def test_a_rank_reads_only_its_own_entry_from_a_dcp_checkpoint(tmp_path):
    """Both ranks' entries in one folder (written by one process); rank 0's holds a value that
    weights_only refuses, so loading it would fail: rank 1 never reads it."""
    checkpoints = CheckpointStore(ArtifactStore(f"file://{tmp_path}"), "j", keep=2)
    mine = {"w": torch.arange(4.0), "opt": {0: {"m": torch.full((2,), 3.0)}}}

    def both_ranks(state: dict) -> dict:
        rank1 = split_replicas(state, lambda t: True, rank=1, world_size=2)
        rank1[REPLICAS]["rank-0"] = {"paths": [["w"]], "values": {"0": torch.zeros(4)},
                                     "poison": fractions.Fraction(1, 3)}
        return rank1

    checkpoints.save(mine, 5, split=both_ranks)
    loaded = checkpoints.load(decode=functools.partial(decode_files, rank=1, world_size=2))
    assert loaded is not None and loaded.step == 5 and not loaded.skipped
    assert torch.equal(loaded.state["w"], torch.arange(4.0))
    assert torch.equal(loaded.state["opt"][0]["m"], torch.full((2,), 3.0))  # int keys come back too
    as_rank0 = checkpoints.load(decode=functools.partial(decode_files, rank=0, world_size=2))
    assert as_rank0 is None  # rank 0's entry is unreadable: skipped as damage, nothing older
    with pytest.raises(InvalidSpec, match="of 2 ranks"):
        checkpoints.load(decode=functools.partial(decode_files, rank=1, world_size=1))
