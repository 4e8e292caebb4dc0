"""A small character-level transformer built as a flat list of blocks.

``CharLM`` is an ``nn.Sequential`` of ``Embedding`` (tokens + positions), ``n_layers``
pre-norm ``Block``s and a ``Head`` (final norm + vocabulary projection): every element maps
one tensor to one tensor, so a pipeline can cut the list anywhere (``build_blocks`` gives the
list itself). Input ``(batch, time)`` token ids, output ``(batch, time, vocab)`` logits.
Causal attention uses ``scaled_dot_product_attention(is_causal=True)``: no mask buffer, so
the model has parameters only (nothing for DDP to broadcast each step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True, frozen=True)
class CharLMConfig:
    vocab_size: int
    context: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        for name in ("vocab_size", "context", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


class Embedding(nn.Module):
    """Token ids (B, T) -> token + learned position embeddings (B, T, d_model)."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(cfg.context, cfg.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.positions.num_embeddings:
            raise ValueError(f"input of {ids.shape[1]} characters is longer than the model's context "
                             f"{self.positions.num_embeddings}; cut it or build the model with a larger context")
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        # qkv's outputs lie head by head ([q k v] of head 0, then of head 1, …): a column split of
        # qkv (tensor parallel) leaves whole heads on each rank, which then attend on their own
        # (``-1``: the heads this rank holds)
        qkv = self.qkv(self.norm1(x)).view(batch, time, -1, 3, width // self.n_heads)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, -1))
        return x + self.mlp(self.norm2(x))

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Megatron's split for ``strategy: {kind: fsdp, tensor_parallel: N}`` (N must divide n_heads):
        qkv and the MLP's first layer by output columns, proj and the MLP's second by input rows."""
        return {"qkv": "colwise", "proj": "rowwise", "mlp.0": "colwise", "mlp.2": "rowwise"}


class Head(nn.Module):
    """(B, T, d_model) -> logits (B, T, vocab)."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_blocks(cfg: CharLMConfig) -> list[nn.Module]:
    """[Embedding, Block × n_layers, Head]: the unit a pipeline partitioner cuts between."""
    return [Embedding(cfg), *(Block(cfg) for _ in range(cfg.n_layers)), Head(cfg)]


class CharLM(nn.Sequential):
    """The blocks of ``build_blocks`` in order; ``model[i]`` is block i."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__(*build_blocks(cfg))
        self.cfg = cfg


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy (nats) over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
