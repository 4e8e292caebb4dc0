"""Sharded data parallel (FSDP2) and tensor parallel as composable steps over a model.

``strategy: {kind: fsdp}`` in a job spec makes ``torchrelay.train.prepare`` run ``prepare`` here
(prepare.py): a ``dp × tp`` device mesh, ``apply_tensor_parallel`` on ``tp``, ``apply_fsdp`` on
``dp``, the optimizer pointed at the shards. Each step has its own small config (config.py),
in torchtitan's shape; the pure parts (units.py: what a unit is; layout.py: the mesh and what
each rank holds; tensor_parallel.py's plan) are tested without processes. See docs/strategies.md.
"""
from torchrelay.train.sharded.config import FSDPConfig, TPConfig, configs_of
from torchrelay.train.sharded.fsdp import apply_fsdp
from torchrelay.train.sharded.layout import Holding, MeshShape, describe_layout, mesh_shape
from torchrelay.train.sharded.module import ShardedModule, full_state_dict
from torchrelay.train.sharded.optimizer import ShardedOptimizer
from torchrelay.train.sharded.prepare import LAYOUT_FILE, build_mesh, prepare
from torchrelay.train.sharded.tensor_parallel import apply_tensor_parallel, tensor_parallel_plan
from torchrelay.train.sharded.units import find_units

__all__ = ["FSDPConfig", "Holding", "LAYOUT_FILE", "MeshShape", "ShardedModule", "ShardedOptimizer", "TPConfig",
           "apply_fsdp", "apply_tensor_parallel", "build_mesh", "configs_of", "describe_layout", "find_units",
           "full_state_dict", "mesh_shape", "prepare", "tensor_parallel_plan"]
