"""Eager attention (``attn_implementation="eager"``): ``bmm(Q, K^T)`` -> scale / softcap / mask ->
softmax -> ``bmm(P, V)``, with each layer's GQA repeat, recognised as attention and cut like SDPA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fx_fastprefill
from fx_fastprefill.passes.attention_nodes import find_attention_nodes
from tests.helpers import aten_graph

DIM, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 16, 4, 2, 8, 50


def eager_attention(q, k, v, mask, softcap):
    """As transformers writes it: repeat K/V for GQA, scores, softcap, mask, softmax in fp32."""
    repeat = q.shape[1] // k.shape[1]
    b, h, s, d = k.shape
    k = k[:, :, None].expand(b, h, repeat, s, d).reshape(b, h * repeat, s, d)
    v = v[:, :, None].expand(b, h, repeat, s, d).reshape(b, h * repeat, s, d)
    scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class EagerShared(nn.Module):
    """Four layers; the last two read layer 1's K/V (KV sharing, as Gemma 3n's trailing layers)."""

    def __init__(self, softcap: float | None):
        super().__init__()
        self.softcap = softcap
        self.embed, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.q = nn.ModuleList(nn.Linear(DIM, HEADS * HEAD_DIM) for _ in range(4))
        self.kv = nn.ModuleList(nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM) for _ in range(4))
        self.o = nn.ModuleList(nn.Linear(HEADS * HEAD_DIM, DIM) for _ in range(4))

    def forward(self, ids, keep: int = 1):
        b, s = ids.shape
        h = self.embed(ids)
        causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
        kv = None
        for i in range(4):
            q = self.q[i](h).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
            if i < 2:
                k, v = self.kv[i](h).view(b, s, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
                kv = (k, v)
            out = eager_attention(q, *kv, causal, self.softcap).transpose(1, 2).reshape(b, s, -1)
            h = h + self.o[i](out)
        return self.head(h[:, -keep:])


def test_the_pattern_is_found_with_its_kv_sharing():
    model = EagerShared(softcap=None).eval()
    gm = aten_graph(lambda ids: model(ids), torch.randint(0, VOCAB, (2, 9)), dynamic={0: [1]})
    layers = find_attention_nodes(gm.graph)
    assert [a.layer for a in layers] == ["eager_attention", "eager_attention#2", "eager_attention#3",
                                         "eager_attention#4"]
    assert [a.kv_source for a in layers] == [None, None, "eager_attention#2", "eager_attention#2"]
    assert all(a.masked and a.node.target is torch.ops.aten.bmm.default for a in layers)


def test_a_matmul_softmax_matmul_without_exp_is_not_attention():
    """Two bmms around a plain elementwise op are not attention: no softmax between them."""
    def fn(x, y, z):
        return torch.bmm(torch.bmm(x, y) * 2.0, z)
    x = torch.randn(2, 5, 4)
    gm = aten_graph(fn, x, torch.randn(2, 4, 5), torch.randn(2, 5, 3))
    assert find_attention_nodes(gm.graph) == []


@pytest.mark.parametrize("softcap, dynamic", [(None, False), (30.0, False), (30.0, True)])
def test_eager_attention_is_cut_and_matches(softcap, dynamic):
    torch.manual_seed(0)
    model = EagerShared(softcap).eval()
    backend = fx_fastprefill.backend(compiler="eager")
    forward = torch.compile(model, backend=backend, dynamic=dynamic)
    for keep in (1, 3):
        ids = torch.randint(0, VOCAB, (3, 11))
        with torch.no_grad():
            torch.testing.assert_close(forward(ids, keep), model(ids, keep), rtol=1e-5, atol=1e-5)
    report = backend.reports[0]
    assert report.cut, report.reason
    assert report.eligible_layers == ["eager_attention#3", "eager_attention#4"]
    assert report.reduced_layers == ["eager_attention#2", "eager_attention#3", "eager_attention#4"]
