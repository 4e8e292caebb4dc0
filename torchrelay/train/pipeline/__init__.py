"""Pipeline parallelism: profile blocks, plan contiguous stages (exact DP), run 1F1B/GPipe.

Public API (see docs/pipeline.md):
- ``prepare(blocks, loss_fn, strategy, ctx, *, sample=..., ...) -> Pipeline``
- ``plan_stages(costs, devices, link, microbatches, schedule) -> Plan`` (pure)
- ``profile_blocks(blocks, sample, device, ...) -> list[BlockCost]``
- ``transformer_blocks(embedding, blocks, head)``, ``build_on_meta(factory)``
"""
from torchrelay.train.pipeline.api import Pipeline, merge_stage_state_dicts, prepare
from torchrelay.train.pipeline.meta import (as_blocks, build_on_meta, materialize_module,
                                            transformer_blocks)
from torchrelay.train.pipeline.partition import (BlockCost, DeviceSpec, Link, Plan,
                                                 PlanInfeasible, StagePlan, equal_split,
                                                 exhaustive_plan, near_optimal_cuts,
                                                 plan_from_boundaries, plan_stages)
from torchrelay.train.pipeline.profile import measure_link, profile_blocks, time_stage

__all__ = [
    "BlockCost", "DeviceSpec", "Link", "Pipeline", "Plan", "PlanInfeasible", "StagePlan",
    "as_blocks", "build_on_meta", "equal_split", "exhaustive_plan", "materialize_module",
    "measure_link", "merge_stage_state_dicts", "near_optimal_cuts", "plan_from_boundaries",
    "plan_stages", "prepare", "profile_blocks", "time_stage", "transformer_blocks",
]
