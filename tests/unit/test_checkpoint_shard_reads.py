"""The pieces of a sharded load that run in one process: which slices are whole rows (``row_span``, pure) and a
load ``target`` that names where tensors go (checkpoint_dcp's ``SafeLoadPlanner``), against a real store. The
sharded load itself, over ranks, is tests/integration/test_sharded_load.py."""
from __future__ import annotations

import pytest
import torch

from torchrelay.storage import ArtifactStore
from torchrelay.train.checkpoint import CheckpointStore, decode_files
from torchrelay.train.checkpoint_dcp import row_span

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.mark.parametrize("sizes, offsets, lengths, expected", [
    ((8, 4), (0, 0), (8, 4), (0, 8)),          # the whole tensor
    ((8, 4), (2, 0), (3, 4), (2, 3)),          # rows 2..4: one contiguous run
    ((8, 4, 2), (6, 0, 0), (2, 4, 2), (6, 2)),
    ((8,), (5,), (3,), (5, 3)),                # 1-D: any slice is rows
    ((8, 4), (0, 2), (8, 2), None),            # columns (a row-parallel weight): not contiguous
    ((8, 4), (1, 0), (2, 3), None),
    ((), (), (), None),                        # a scalar: read whole
    ((8, 4), (0,), (8,), None),                # malformed: read whole
])
def test_row_span(sizes, offsets, lengths, expected) -> None:
    assert row_span(sizes, offsets, lengths) == expected


@pytest.fixture
def checkpoints(tmp_path) -> CheckpointStore:
    return CheckpointStore(ArtifactStore(str(tmp_path / "store")), "job1", keep=3)


def test_a_target_receives_the_tensors_it_names_and_the_rest_are_rebuilt(checkpoints) -> None:
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}, "step": 5}
    checkpoints.save(state, 5)
    into = torch.full((3, 4), -1.0)
    asked = []

    def target(path, stored):
        asked.append((path, tuple(stored.size)))
        return into if path == ("model", "w") else None

    loaded = decode_files(checkpoints, "step-0000000005", target=target)
    assert loaded["model"]["w"] is into and torch.equal(into, state["model"]["w"])  # loaded in place
    assert torch.equal(loaded["model"]["b"], torch.ones(3)) and loaded["step"] == 5
    assert sorted(asked) == [(("model", "b"), (3,)), (("model", "w"), (3, 4))]  # tensors only, by their path
