"""Small models built as block lists, for the pipeline's tests and bench.

Contract: every function returns a list of blocks (one tensor in, one tensor out) whose every
parameter-owning submodule has ``reset_parameters()``, so it can be built on the meta device.
- ``balanced_mlp(width, depth)``: ``depth`` equal Linear+Tanh blocks.
- ``char_transformer(vocab, dim, depth, heads, context)``: token embedding (+ learned
  positions), ``depth`` pre-norm causal transformer blocks, head (norm + Linear to ``vocab``).
  With a large ``vocab`` the embedding and especially the head dominate, which is the case
  where an equal-layer split is poor. ``lm_loss`` is its loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchrelay.train.pipeline.meta import transformer_blocks


def balanced_mlp(width: int = 256, depth: int = 8) -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]


class TokenEmbedding(nn.Module):
    """Token ids (batch, time) -> vectors (batch, time, dim) with learned positions."""

    def __init__(self, vocab: int, dim: int, context: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.empty(context, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def char_transformer(vocab: int = 4096, dim: int = 128, depth: int = 6, heads: int = 4,
                     context: int = 64) -> list[nn.Module]:
    return transformer_blocks(
        TokenEmbedding(vocab, dim, context),
        [TransformerBlock(dim, heads) for _ in range(depth)],
        (nn.LayerNorm(dim), nn.Linear(dim, vocab)),
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


__all__ = ["balanced_mlp", "char_transformer", "lm_loss", "mse_loss", "TokenEmbedding",
           "TransformerBlock"]
