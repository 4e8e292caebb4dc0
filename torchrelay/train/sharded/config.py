"""The typed settings of each sharding step, read from the job's strategy. Pure: no torch.distributed.

Each ``apply_*`` step takes its own small config (torchtitan's shape) instead of the whole
strategy:

- ``FSDPConfig`` — ``apply_fsdp``: which submodules are units, reshard after forward, the
  parameter dtype of mixed precision, CPU offload.
- ``TPConfig`` — ``apply_tensor_parallel``: the degree (workers per tensor-parallel group).

``configs_of(strategy)`` reads both from an ``FSDPStrategy``, or from a ``PipelineStrategy``
whose ``data_parallel`` is ``fsdp`` (no tensor parallel there). ``mixed_precision_dtypes``
turns the spec's word into dtypes and refuses what the device cannot do (``InvalidSpec``
naming the value): bf16 runs on CPU and GPU; fp16 only on GPU (CPU kernels for half matrix
products are slow or missing, and fp16 needs a loss scaler that FSDP does not add).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchrelay.errors import InvalidSpec

__all__ = ["FSDPConfig", "TPConfig", "configs_of", "mixed_precision_dtypes"]


@dataclass(kw_only=True, slots=True, frozen=True)
class FSDPConfig:
    """What ``apply_fsdp`` needs. ``wrap``: "auto" or class names of the unit modules."""

    wrap: str | tuple[str, ...] = "auto"
    reshard_after_forward: bool = True
    mixed_precision: str = "none"  # "none" | "bf16" | "fp16"
    offload: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class TPConfig:
    """What ``apply_tensor_parallel`` needs: workers per tensor-parallel group (1: none)."""

    degree: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 1:
            raise InvalidSpec(f"strategy.tensor_parallel={self.degree!r} must be an integer >= 1")


def configs_of(strategy: Any) -> tuple[FSDPConfig, TPConfig]:
    """The steps' configs of ``strategy`` (an ``FSDPStrategy``, or a pipeline with ``data_parallel: fsdp``)."""
    kind = getattr(strategy, "kind", None)
    if kind == "fsdp":
        wrap = strategy.wrap if strategy.wrap == "auto" else tuple(strategy.wrap)
        return (FSDPConfig(wrap=wrap, reshard_after_forward=strategy.reshard_after_forward,
                           mixed_precision=strategy.mixed_precision, offload=strategy.offload_optimizer),
                TPConfig(degree=strategy.tensor_parallel))
    if kind == "pipeline" and getattr(strategy, "data_parallel", "ddp") == "fsdp":
        return FSDPConfig(), TPConfig()
    raise InvalidSpec(f"strategy kind {kind!r} does not shard; use kind 'fsdp' or a pipeline with "
                      "data_parallel 'fsdp'")


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_dtypes(word: str, device_type: str) -> tuple[torch.dtype, torch.dtype] | None:
    """(parameter dtype, gradient-reduction dtype) for ``word`` on ``device_type``; None for "none".

    Raises ``InvalidSpec`` for an unknown word or fp16 on a CPU worker."""
    if word == "none":
        return None
    if word not in _DTYPES:
        raise InvalidSpec(f"strategy.mixed_precision={word!r}; use 'none', 'bf16' or 'fp16'")
    if word == "fp16" and device_type != "cuda":
        raise InvalidSpec(f"strategy.mixed_precision='fp16' needs GPU workers, this one runs on {device_type}; "
                          "use 'bf16' (CPU and GPU) or 'none'")
    return _DTYPES[word], torch.float32
