"""An ordinary decoder with no KV sharing: the pass keeps it correct and saves only the last
layer's tail (its query path, output projection and MLP run on the logits rows).

    python examples/dense.py              # tiny config on the CPU: prints the report and checks itself
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

if not __package__:  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.blocks import MLP, Attention, RMSNorm  # noqa: E402


@dataclass
class Config:
    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    mlp_hidden: int = 128


PRESETS = {
    "tiny": Config(),
    "1b": Config(vocab_size=32768, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, mlp_hidden=8192),
}


class Block(nn.Module):
    def __init__(self, cfg: Config, i: int):
        super().__init__()
        self.attn = Attention(f"layers.{i}", cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.mlp = MLP(cfg.dim, cfg.mlp_hidden)
        self.norm1, self.norm2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)

    def forward(self, x, positions):
        x = x + self.attn(self.norm1(x), positions)
        return x + self.mlp(self.norm2(x))


class Dense(nn.Module):
    def __init__(self, cfg: Config = Config()):
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids, positions, logits_indices):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(self.norm(x[logits_indices]))


def tiny() -> Dense:
    torch.manual_seed(0)
    return Dense(Config())


if __name__ == "__main__":
    from examples.check import main
    main(Dense, PRESETS, __doc__)
