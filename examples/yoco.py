"""A YOCO-shaped flat-batch model: a self-decoder of sliding-window layers, then cross-decoder
layers that all attend to one K/V computed once from the self-decoder's output.

    python examples/yoco.py               # tiny config on the CPU: prints the report and checks itself
    python examples/yoco.py --preset 1b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

if not __package__:  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.blocks import MLP, RMSNorm, rope  # noqa: E402
import fx_fastprefill  # noqa: E402


@dataclass
class Config:
    vocab_size: int = 512
    dim: int = 64
    n_self: int = 3
    n_cross: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    mlp_hidden: int = 128
    sliding_window: int = 8


PRESETS = {
    "tiny": Config(),
    "1b": Config(vocab_size=32768, dim=2048, n_self=12, n_cross=12, n_heads=16, n_kv_heads=4, head_dim=128,
                 mlp_hidden=5632, sliding_window=1024),
}


class SelfLayer(nn.Module):
    def __init__(self, cfg: Config, i: int):
        super().__init__()
        self.name, self.cfg = f"self.{i}", cfg
        self.qkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.mlp = MLP(cfg.dim, cfg.mlp_hidden)
        self.norm1, self.norm2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)

    def forward(self, x, positions):
        c = self.cfg
        q, k, v = self.qkv(self.norm1(x)).split(
            [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], -1
        )
        q = rope(q.view(-1, c.n_heads, c.head_dim), positions)
        k = rope(k.view(-1, c.n_kv_heads, c.head_dim), positions)
        out = fx_fastprefill.attention(q, k, v.view(-1, c.n_kv_heads, c.head_dim), layer=self.name,
                                       sliding_window=c.sliding_window)
        x = x + self.o(out.reshape(-1, c.n_heads * c.head_dim))
        return x + self.mlp(self.norm2(x))


class CrossLayer(nn.Module):
    """Attends to the shared K/V: the first cross layer owns the cache, the others read it."""

    def __init__(self, cfg: Config, i: int):
        super().__init__()
        self.name, self.cfg = f"cross.{i}", cfg
        self.kv_source = None if i == 0 else "cross.0"
        self.q = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.mlp = MLP(cfg.dim, cfg.mlp_hidden)
        self.norm1, self.norm2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)

    def forward(self, x, positions, k, v):
        c = self.cfg
        q = rope(self.q(self.norm1(x)).view(-1, c.n_heads, c.head_dim), positions)
        if self.kv_source is not None:
            k = v = None
        out = fx_fastprefill.attention(q, k, v, layer=self.name, kv_source=self.kv_source)
        x = x + self.o(out.reshape(-1, c.n_heads * c.head_dim))
        return x + self.mlp(self.norm2(x))


class YocoLike(nn.Module):
    def __init__(self, cfg: Config = Config()):
        super().__init__()
        self.cfg, self.vocab_size = cfg, cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.self_layers = nn.ModuleList(SelfLayer(cfg, i) for i in range(cfg.n_self))
        self.kv_norm = RMSNorm(cfg.dim)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.cross_layers = nn.ModuleList(CrossLayer(cfg, i) for i in range(cfg.n_cross))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids, positions, logits_indices):
        c = self.cfg
        x = self.embed(input_ids)
        for layer in self.self_layers:
            x = layer(x, positions)
        h = self.kv_norm(x)
        k = rope(self.k_proj(h).view(-1, c.n_kv_heads, c.head_dim), positions)
        v = self.v_proj(h).view(-1, c.n_kv_heads, c.head_dim)
        for layer in self.cross_layers:
            x = layer(x, positions, k, v)
        return self.head(self.norm(x[logits_indices]))


def tiny() -> YocoLike:
    torch.manual_seed(0)
    return YocoLike(Config())


if __name__ == "__main__":
    from examples.check import main
    main(YocoLike, PRESETS, __doc__)
