"""Tensor parallel inside pipeline stages, the pure parts: the spec's rule and where each stage's ranks sit."""
from __future__ import annotations

import json

import pytest

from torchrelay.errors import InvalidSpec
from torchrelay.spec import PipelineStrategy
from torchrelay.train.environment import parse_strategy
from torchrelay.train.pipeline.api import _stage_ranks
from torchrelay.train.sharded.layout import MeshShape


@pytest.mark.parametrize("stages, replicas, tp, t, expected", [
    (2, 2, 1, 0, [[0, 1], [2, 3]]),              # as before: rank = replica × stages + stage
    (2, 1, 2, 0, [[0, 2]]),                      # tp 2: each stage is 2 consecutive ranks
    (2, 1, 2, 1, [[1, 3]]),
    (2, 2, 2, 1, [[1, 3], [5, 7]]),
])
def test_stage_ranks_at_each_tensor_parallel_place(stages, replicas, tp, t, expected) -> None:
    assert _stage_ranks(stages, replicas, tp, t) == expected
    shape = MeshShape(pp=stages, dp=replicas, tp=tp)
    for replica, line in enumerate(expected):  # the mesh's coordinates agree
        assert [shape.coordinates(r) for r in line] == [{"pp": k, "dp": replica, "tp": t} for k in range(stages)]


def test_tensor_parallel_in_a_pipeline_needs_fsdp() -> None:
    ok = PipelineStrategy(kind="pipeline", stages=2, data_parallel="fsdp", tensor_parallel=2)
    assert ok.tensor_parallel == 2 and PipelineStrategy(kind="pipeline").tensor_parallel == 1
    with pytest.raises(InvalidSpec, match="tensor_parallel=2 inside pipeline stages needs data_parallel: fsdp"):
        parse_strategy(json.dumps({"kind": "pipeline", "stages": 2, "tensor_parallel": 2}))
    with pytest.raises(InvalidSpec, match="tensor_parallel"):
        parse_strategy(json.dumps({"kind": "pipeline", "stages": 2, "data_parallel": "fsdp", "tensor_parallel": 0}))
