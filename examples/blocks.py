"""Pieces shared by the example models: norm, rotary embedding, MLP, attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fx_fastprefill


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, positions, base: float = 10000.0):
    """Rotary embedding of x [T, H, D] at the given positions [T]."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class Attention(nn.Module):
    """Grouped-query attention with q/k norms; a KV-sharing layer has no k/v projections."""

    def __init__(self, name: str, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 kv_source: str | None = None, sliding_window: int | None = None):
        super().__init__()
        self.name, self.kv_source, self.sliding_window = name, kv_source, sliding_window
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim)
        if kv_source is None:
            self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
            self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
            self.k_norm = RMSNorm(head_dim)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, positions, query_rows=None):
        q = rope(self.q_norm(self.q_proj(x).view(-1, self.n_heads, self.head_dim)), positions)
        k = v = None
        if self.kv_source is None:
            k = rope(self.k_norm(self.k_proj(x).view(-1, self.n_kv_heads, self.head_dim)), positions)
            v = self.v_proj(x).view(-1, self.n_kv_heads, self.head_dim)
        out = fx_fastprefill.attention(q, k, v, layer=self.name, kv_source=self.kv_source,
                                       sliding_window=self.sliding_window, query_rows=query_rows)
        return self.o_proj(out.reshape(-1, self.n_heads * self.head_dim))
