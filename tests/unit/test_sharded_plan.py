"""The pure parts of sharding: units, the mesh, tensor-parallel plans, configs, memory estimates and the spec."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torchrelay.errors import InsufficientMemory, InvalidSpec
from torchrelay.spec import FSDPStrategy, JobSpec, PipelineStrategy
from torchrelay.train.memory import MemoryFigures, check_fits, estimate_training_state, optimizer_state_factor
from torchrelay.train.memory_check import estimate, memory_limit, preflight, process_baseline
from torchrelay.train.sharded.config import FSDPConfig, TPConfig, configs_of, mixed_precision_dtypes
from torchrelay.train.sharded.layout import Holding, MeshShape, describe_layout, layout_dict, mesh_shape
from torchrelay.train.sharded.tensor_parallel import tensor_parallel_plan
from torchrelay.train.sharded.units import find_units


class Blocks(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(8, 10)
        if tie:
            self.head.weight = self.embed.weight


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Module()
        self.body.stack = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.out = nn.Linear(4, 1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"qkv": "colwise", "proj": "rowwise"}


@pytest.mark.parametrize("model, wrap, units, note", [
    (nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), "auto", ["0", "2"], None),
    (Blocks(), "auto", ["layers.0", "layers.1", "layers.2"], None),
    (Inner(), "auto", ["body.stack.0", "body.stack.1"], None),
    (nn.Linear(2, 2), "auto", [], "no repeated blocks"),
    (Blocks(), ("Linear",), ["layers.0.0", "layers.1.0", "layers.2.0", "head"], None),
    (Blocks(tie=True), ("Embedding", "Linear"), ["layers.0.0", "layers.1.0", "layers.2.0"], "shares a parameter"),
    (Blocks(), ("Sequential", "Linear"), ["layers.0", "layers.1", "layers.2", "head"], None),  # outermost only
])
def test_units(model: nn.Module, wrap, units: list[str], note: str | None) -> None:
    found, notes = find_units(model, wrap)
    assert found == units
    assert (note is None and not notes) or any(note in n for n in notes)


def test_units_refuse_a_class_the_model_lacks() -> None:
    with pytest.raises(InvalidSpec, match=r"\['Block'\].*its classes are"):
        find_units(Blocks(), ("Block",))


@pytest.mark.parametrize("world, tp, stages, shape", [
    (4, 1, 1, MeshShape(dp=4)), (4, 2, 1, MeshShape(dp=2, tp=2)), (8, 2, 2, MeshShape(pp=2, dp=2, tp=2)),
    (2, 1, 2, MeshShape(pp=2, dp=1)), (1, 1, 1, MeshShape()),
])
def test_mesh_shape(world: int, tp: int, stages: int, shape: MeshShape) -> None:
    assert mesh_shape(world, tensor_parallel=tp, stages=stages) == shape
    assert shape.world_size == world


@pytest.mark.parametrize("world, tp, stages, match", [
    (6, 4, 1, "workers=6 is not a multiple of stages × tensor_parallel = 1 × 4"),
    (4, 0, 1, "tensor_parallel=0"), (3, 1, 2, "use workers = 2 × k"),
])
def test_mesh_shape_refuses(world: int, tp: int, stages: int, match: str) -> None:
    with pytest.raises(InvalidSpec, match=match):
        mesh_shape(world, tensor_parallel=tp, stages=stages)


def test_mesh_coordinates_put_tensor_parallel_ranks_and_a_replicas_stages_next_to_each_other() -> None:
    shape = MeshShape(pp=2, dp=2, tp=2)
    assert [shape.coordinates(r) for r in (0, 1, 2, 5, 7)] == [
        {"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 1}, {"pp": 1, "dp": 0, "tp": 0},
        {"pp": 0, "dp": 1, "tp": 1}, {"pp": 1, "dp": 1, "tp": 1}]
    pipeline = MeshShape(pp=2, dp=2)  # rank = replica × stages + stage, as the pipeline lays ranks out
    assert [(pipeline.coordinates(r)["dp"], pipeline.coordinates(r)["pp"]) for r in range(4)] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert shape.text() == "pp 2 × dp 2 × tp 2"
    with pytest.raises(ValueError):
        shape.coordinates(8)


def test_layout_text_and_dict() -> None:
    shape = MeshShape(dp=2, tp=2)
    holdings = [Holding(rank=r, coordinates=shape.coordinates(r), units=("a", "b"), parameter_bytes=256,
                        full_parameter_bytes=1024, tensor_parallel_modules=("qkv",), notes=("n1",)) for r in range(4)]
    text = describe_layout(shape, holdings)
    assert text.splitlines()[0].startswith("mesh dp 2 × tp 2 (4 ranks)")
    assert "rank 3 [dp=1 tp=1]: 256B of 1.0KiB parameters (25%), 2 FSDP units" in text
    assert "tensor parallel: qkv" in text and text.count("note: n1") == 1
    body = layout_dict(shape, holdings)
    assert body["mesh"] == {"pp": 1, "dp": 2, "tp": 2, "world_size": 4} and body["ranks"][2]["fraction"] == 0.25


def test_tensor_parallel_plan_declared_and_mlp_pairs() -> None:
    model = nn.Sequential(Attention(), nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), nn.Linear(8, 8))
    assert tensor_parallel_plan(model) == {"0.qkv": "colwise", "0.proj": "rowwise", "1.0": "colwise",
                                           "1.2": "rowwise"}


@pytest.mark.parametrize("model, degree, match", [
    (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), 2, "nothing to split"),
    (nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4)), 4, "6 output features, not divisible"),
])
def test_tensor_parallel_plan_refuses(model: nn.Module, degree: int, match: str) -> None:
    with pytest.raises(InvalidSpec, match=match):
        tensor_parallel_plan(model, degree)


def test_configs_and_mixed_precision() -> None:
    fsdp, tp = configs_of(FSDPStrategy(kind="fsdp", wrap=["Block"], mixed_precision="bf16", tensor_parallel=2))
    assert fsdp == FSDPConfig(wrap=("Block",), mixed_precision="bf16") and tp == TPConfig(degree=2)
    assert configs_of(PipelineStrategy(kind="pipeline", data_parallel="fsdp")) == (FSDPConfig(), TPConfig())
    with pytest.raises(InvalidSpec, match="does not shard"):
        configs_of(PipelineStrategy(kind="pipeline"))
    assert mixed_precision_dtypes("none", "cpu") is None
    assert mixed_precision_dtypes("bf16", "cpu") == (torch.bfloat16, torch.float32)
    assert mixed_precision_dtypes("fp16", "cuda") == (torch.float16, torch.float32)
    with pytest.raises(InvalidSpec, match="'fp16' needs GPU workers"):
        mixed_precision_dtypes("fp16", "cpu")


@pytest.mark.parametrize("name, defaults, factor", [
    ("Adam", {}, 2.0), ("AdamW", {"amsgrad": True}, 3.0), ("SGD", {"momentum": 0.0}, 0.0),
    ("SGD", {"momentum": 0.9}, 1.0), ("RMSprop", {"momentum": 0.9, "centered": True}, 3.0), ("Adagrad", {}, 1.0),
])
def test_optimizer_state_factor(name: str, defaults: dict, factor: float) -> None:
    assert optimizer_state_factor(name, defaults) == (factor, None)


def test_optimizer_state_factor_of_an_unknown_optimizer_says_so() -> None:
    factor, note = optimizer_state_factor("Lion", {})
    assert factor == 2.0 and "Lion" in note


@pytest.mark.parametrize("shards, unit, buckets, expected", [
    (1, 0, False, MemoryFigures(parameters=1000, gradients=1000, optimizer_state=2000)),
    (1, 0, True, MemoryFigures(parameters=1000, gradients=2000, optimizer_state=2000)),
    (4, 100, False, MemoryFigures(parameters=350, gradients=350, optimizer_state=500)),
])
def test_estimate_training_state(shards: int, unit: int, buckets: bool, expected: MemoryFigures) -> None:
    assert estimate_training_state(parameter_bytes=1000, trainable_bytes=1000, largest_unit_bytes=unit,
                                   optimizer_factor=2.0, shards=shards, ddp_buckets=buckets) == expected


def test_check_fits_names_the_figures_and_the_way_out() -> None:
    whole = MemoryFigures(parameters=2 << 20, gradients=4 << 20, optimizer_state=4 << 20)
    sharded = MemoryFigures(parameters=1 << 20, gradients=1 << 20, optimizer_state=2 << 20)
    check_fits(whole, 0, strategy="ddp", workers=2)  # no limit: nothing to check
    check_fits(whole, 10 << 20, strategy="ddp", workers=2)
    with pytest.raises(InsufficientMemory) as err:
        check_fits(whole, 8 << 20, strategy="ddp", workers=2, sharded=sharded)
    assert str(err.value) == (
        "memory: the training state needs 10.0MiB per worker under ddp on 2 workers (parameters 2.0MiB, "
        "gradients 4.0MiB, optimizer state 4.0MiB), but each worker has 8.0MiB (resources.memory); strategy fsdp "
        "on the same 2 workers needs 4.0MiB per worker (fits); or give each worker more memory (resources.memory)")
    with pytest.raises(InsufficientMemory, match="use more workers"):
        check_fits(sharded, 1 << 20, strategy="fsdp", workers=2)


def test_preflight_from_the_model_and_the_environment() -> None:
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # 4 × 257 KiB
    opt = torch.optim.Adam(model.parameters())
    ddp = estimate(model, opt, None, 2)
    fsdp = estimate(model, opt, FSDPStrategy(kind="fsdp"), 2)
    assert ddp.training_state == 5 * ddp.parameters and fsdp.training_state < 0.6 * ddp.training_state
    assert preflight(model, opt, None, 2, {}) is None  # no limit
    limit = str((ddp.training_state + fsdp.training_state) // 2)
    with pytest.raises(InsufficientMemory, match=r"under ddp on 2 workers .* \(fits\)"):
        preflight(model, opt, None, 2, {"RELAY_MEMORY_PER_WORKER": limit}, baseline=0)
    assert preflight(model, opt, FSDPStrategy(kind="fsdp"), 2, {"RELAY_MEMORY_PER_WORKER": limit}, baseline=0) == fsdp
    # what the process holds besides training counts too (a cgroup limit counts the whole process)
    with pytest.raises(InsufficientMemory, match=r"besides 2.0MiB the process holds already"):
        preflight(model, opt, FSDPStrategy(kind="fsdp"), 2, {"RELAY_MEMORY_PER_WORKER": limit}, baseline=2 << 20)
    assert process_baseline(model) > 50 << 20  # this interpreter with torch, measured
    assert memory_limit({"RELAY_MEMORY_PER_WORKER": "1GiB"}) == 1 << 30
    with pytest.raises(InvalidSpec, match="RELAY_MEMORY_PER_WORKER='lots'"):
        memory_limit({"RELAY_MEMORY_PER_WORKER": "lots"})


@pytest.mark.parametrize("strategy, workers, match", [
    ({"kind": "fsdp", "tensor_parallel": 3}, 4, "tensor_parallel=3 must divide workers=4"),
    ({"kind": "fsdp", "mixed_precision": "fp8"}, 2, "strategy.mixed_precision"),
    ({"kind": "fsdp", "wrap": []}, 2, "non-empty list of module class names"),
    ({"kind": "fsdp", "shards": 2}, 2, "unknown key 'shards'"),
    ({"kind": "pipeline", "data_parallel": "zero"}, 2, "strategy.data_parallel"),
])
def test_spec_refuses(strategy: dict, workers: int, match: str) -> None:
    with pytest.raises(InvalidSpec, match=match):
        JobSpec.parse({"entrypoint": "python t.py", "workers": workers, "strategy": strategy})


def test_spec_accepts_fsdp() -> None:
    spec = JobSpec.parse({"entrypoint": "python t.py", "workers": 4,
                          "strategy": {"kind": "fsdp", "tensor_parallel": 2, "wrap": ["Block"]}})
    assert spec.strategy.kind == "fsdp" and spec.strategy.reshard_after_forward is True
    assert JobSpec.parse(spec.to_public()) == spec


def test_the_partitioner_plans_with_each_stages_sharded_memory() -> None:
    from torchrelay.train.pipeline.partition import BlockCost, DeviceSpec, PlanInfeasible, plan_stages, sharded_costs

    blocks = [BlockCost(time_s=1.0, param_bytes=400) for _ in range(4)]
    devices = [DeviceSpec(mem_cap_bytes=600)] * 2  # a stage of two whole blocks needs 800
    with pytest.raises(PlanInfeasible):
        plan_stages(blocks, devices)
    costs, reserve = sharded_costs(blocks, 4)
    assert [c.param_bytes for c in costs] == [100] * 4 and reserve == 400  # one block gathered at a time
    capped = [DeviceSpec(mem_cap_bytes=600 - reserve)] * 2
    assert plan_stages(costs, capped).boundaries == (0, 2)  # first block of each stage
    assert sharded_costs(blocks, 1) == (blocks, 0)


def test_a_plain_optimizer_state_by_index_is_keyed_by_name() -> None:
    from torchrelay.train.sharded.optimizer import _by_name

    plain = {"state": {0: {"step": 1}, 1: {"step": 2}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    assert _by_name(plain, ["a.weight", "a.bias"]) == {
        "state": {"a.weight": {"step": 1}, "a.bias": {"step": 2}},
        "param_groups": [{"lr": 0.1, "params": ["a.weight", "a.bias"]}]}
    named = {"state": {"a.weight": {"step": 1}}, "param_groups": [{"params": ["a.weight"]}]}
    assert _by_name(named, ["a.weight"]) is named


@pytest.mark.parametrize("strategy, world, shares", [
    (None, 4, [(0, 4), (1, 4), (2, 4), (3, 4)]),
    (FSDPStrategy(kind="fsdp"), 4, [(0, 4), (1, 4), (2, 4), (3, 4)]),
    (FSDPStrategy(kind="fsdp", tensor_parallel=2), 4, [(0, 2), (0, 2), (1, 2), (1, 2)]),
])
def test_the_ranks_of_a_tensor_parallel_group_read_one_share_of_the_data(strategy, world: int, shares) -> None:
    from torchrelay.train.roles import Roles

    assert [Roles.of(r, world, strategy).data_world() for r in range(world)] == shares
