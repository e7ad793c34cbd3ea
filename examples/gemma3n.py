"""A Gemma-3n-shaped flat-batch model: 4 sliding + 1 full layer pattern, trailing KV-sharing layers,
AltUp-style hidden streams and per-layer inputs.

    python examples/gemma3n.py            # tiny config on the CPU: prints the report and checks itself
    python examples/gemma3n.py --preset e2b --device cuda --dtype bfloat16
    python examples/gemma3n.py --device cuda --cudagraphs    # piecewise CUDA graphs, recorded up front
"""

from __future__ import annotations

from dataclasses import dataclass

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if not __package__:  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.blocks import MLP, Attention, RMSNorm  # noqa: E402


@dataclass
class Config:
    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 10
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    mlp_hidden: int = 128
    sliding_window: int = 8
    pattern: int = 5              # every 5th layer is full attention, the others sliding
    num_kv_shared_layers: int = 4
    num_streams: int = 4          # AltUp hidden streams
    per_layer_dim: int = 8        # per-layer input width
    softcap: float = 30.0


PRESETS = {
    "tiny": Config(),
    "e2b": Config(vocab_size=262144, dim=2048, n_layers=30, n_heads=8, n_kv_heads=2, head_dim=256,
                  mlp_hidden=8192, sliding_window=512, num_kv_shared_layers=10, per_layer_dim=256),
}


def layer_is_sliding(cfg: Config, i: int) -> bool:
    return (i + 1) % cfg.pattern != 0


def kv_sources(cfg: Config) -> list[str | None]:
    """Shared layers read the last non-shared layer of the same type."""
    first_shared = cfg.n_layers - cfg.num_kv_shared_layers
    sources = []
    for i in range(cfg.n_layers):
        if i < first_shared:
            sources.append(None)
        else:
            same_type = [j for j in range(first_shared) if layer_is_sliding(cfg, j) == layer_is_sliding(cfg, i)]
            if not same_type:
                kind = "sliding" if layer_is_sliding(cfg, i) else "full"
                raise ValueError(f"Config: shared layer {i} is {kind}, but none of the {first_shared} layers before "
                                 f"the sharing run is: lower num_kv_shared_layers or change pattern")
            sources.append(f"layers.{same_type[-1]}")
    return sources


class Layer(nn.Module):
    def __init__(self, cfg: Config, i: int, kv_source: str | None):
        super().__init__()
        window = cfg.sliding_window if layer_is_sliding(cfg, i) else None
        self.attn = Attention(f"layers.{i}", cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, kv_source, window)
        self.mlp = MLP(cfg.dim, cfg.mlp_hidden)
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.predict = nn.Parameter(torch.eye(cfg.num_streams) + 0.02 * torch.randn(cfg.num_streams, cfg.num_streams))
        self.correct = nn.Parameter(torch.ones(cfg.num_streams))
        self.per_layer_gate = nn.Linear(cfg.dim, cfg.per_layer_dim, bias=False)
        self.per_layer_proj = nn.Linear(cfg.per_layer_dim, cfg.dim, bias=False)

    def forward(self, streams, per_layer_input, positions, query_rows=None):
        # streams: [S, T, D]. AltUp: predict every stream, run the block on stream 0, correct all.
        predicted = torch.einsum("st,tnd->snd", self.predict, streams)
        x = predicted[0]
        x = x + self.attn(self.attn_norm(x), positions, query_rows)
        x = x + self.mlp(self.mlp_norm(x))
        corrected = predicted + self.correct[:, None, None] * (x - predicted[0])[None]
        gate = F.gelu(self.per_layer_gate(x), approximate="tanh") * per_layer_input
        return torch.cat([corrected[:1], corrected[1:] + self.per_layer_proj(gate)[None]])


class Gemma3nLike(nn.Module):
    """``hand_split=True``: the split a manual port writes (what vLLM and transformers hand-code):
    the layers before the KV-sharing run on all rows, then the rows needing logits are gathered and
    the sharing layers run on them only."""

    def __init__(self, cfg: Config = Config(), hand_split: bool = False):
        super().__init__()
        self.cfg = cfg
        self.hand_split = hand_split
        self.first_shared = cfg.n_layers - cfg.num_kv_shared_layers
        self.vocab_size = cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.stream_up = nn.Linear(cfg.dim, (cfg.num_streams - 1) * cfg.dim, bias=False)
        self.per_layer_embed = nn.Embedding(cfg.vocab_size, cfg.n_layers * cfg.per_layer_dim)
        self.per_layer_from_hidden = nn.Linear(cfg.dim, cfg.n_layers * cfg.per_layer_dim, bias=False)
        self.layers = nn.ModuleList(Layer(cfg, i, src) for i, src in enumerate(kv_sources(cfg)))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids, positions, logits_indices):
        cfg = self.cfg
        h = self.embed(input_ids) * cfg.dim ** 0.5
        per_layer = (self.per_layer_embed(input_ids) + self.per_layer_from_hidden(h)).view(
            -1, cfg.n_layers, cfg.per_layer_dim
        )
        streams = torch.cat([h[None], self.stream_up(h).view(-1, cfg.num_streams - 1, cfg.dim).transpose(0, 1)])
        rows = None
        for i, layer in enumerate(self.layers):
            if self.hand_split and i == self.first_shared:
                streams, per_layer, positions = (
                    streams[:, logits_indices],
                    per_layer[logits_indices],
                    positions[logits_indices],
                )
                rows = logits_indices
            streams = layer(streams, per_layer[:, i], positions, rows)
        h = streams.mean(0) if rows is not None else streams.mean(0)[logits_indices]
        logits = self.head(self.norm(h))
        return torch.tanh(logits / cfg.softcap) * cfg.softcap


def tiny() -> Gemma3nLike:
    torch.manual_seed(0)
    return Gemma3nLike(Config())


if __name__ == "__main__":
    from examples.check import main
    main(Gemma3nLike, PRESETS, __doc__)
