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
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        heads = lambda t: t.view(batch, time, self.n_heads, width // self.n_heads).transpose(1, 2)  # noqa: E731
        attended = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, width))
        return x + self.mlp(self.norm2(x))


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
