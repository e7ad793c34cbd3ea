"""Random flat-convention models for differential fuzzing: structure drawn from a spec.

A ``ModelSpec`` fixes the layer count, which layers compute their own K/V and which read whose,
sliding windows, GQA ratios, an optional second residual stream and per-layer inputs (both cross
the cut), and optional row-mixing ops (a cumulative sum or a running mean over tokens) placed after
some layer, where the hoist must stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from examples.blocks import MLP, Attention, RMSNorm

HEAD_DIM = 8
DIM = 32
VOCAB = 97


@dataclass(frozen=True)
class LayerSpec:
    kv_source: int | None     # index of an earlier layer with its own K/V, or None
    kv_heads: int             # of this layer's own K/V (ignored when sharing)
    q_per_kv: int             # query heads per KV head of the K/V it reads
    window: int | None


@dataclass(frozen=True)
class ModelSpec:
    layers: tuple[LayerSpec, ...]
    second_stream: bool = False
    per_layer_inputs: bool = False
    mixing: dict = field(default_factory=dict)  # layer index -> "cumsum" | "running_mean"

    def kv_heads_read(self, i: int) -> int:
        layer = self.layers[i]
        return self.layers[layer.kv_source].kv_heads if layer.kv_source is not None else layer.kv_heads


def mix_rows(h: torch.Tensor, kind: str) -> torch.Tensor:
    """Row-mixing ops, causal along the flat batch (trailing padding rows do not change them)."""
    running = h.cumsum(0)
    if kind == "running_mean":
        running = running / torch.arange(1, h.shape[0] + 1, device=h.device, dtype=h.dtype)[:, None]
    return h + 0.1 * running


class FuzzModel(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.vocab_size = VOCAB
        n = len(spec.layers)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = nn.ModuleList()
        for i, layer in enumerate(spec.layers):
            kv = spec.kv_heads_read(i)
            source = f"attn.{layer.kv_source}" if layer.kv_source is not None else None
            self.attn.append(Attention(f"attn.{i}", DIM, kv * layer.q_per_kv, kv, HEAD_DIM, source, layer.window))
        self.norms = nn.ModuleList(RMSNorm(DIM) for _ in range(n))
        self.mlps = nn.ModuleList(MLP(DIM, 2 * DIM) for _ in range(n))
        if spec.second_stream:
            self.stream_mix = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(n))
        if spec.per_layer_inputs:
            self.per_layer = nn.Embedding(VOCAB, n * 4)
            self.per_layer_proj = nn.ModuleList(nn.Linear(4, DIM, bias=False) for _ in range(n))
        self.final_norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, positions, logits_indices):
        h = self.embed(input_ids)
        side = h * 0.5 if self.spec.second_stream else None
        per_layer = self.per_layer(input_ids).view(-1, len(self.spec.layers), 4) if self.spec.per_layer_inputs else None
        for i in range(len(self.spec.layers)):
            h = h + self.attn[i](self.norms[i](h), positions)
            if per_layer is not None:
                h = h + self.per_layer_proj[i](per_layer[:, i])
            h = h + self.mlps[i](h)
            if side is not None:
                side = side + torch.tanh(self.stream_mix[i](h))
                h = h + 0.1 * side
            if i in self.spec.mixing:
                h = mix_rows(h, self.spec.mixing[i])
        if side is not None:
            h = h + side
        return self.head(self.final_norm(h[logits_indices]))
