"""MoE experts dispatched by a sort (transformers' ``grouped_mm`` form): row-wise as a block
(passes/sorted_dispatch.py), so the gather hoists through it; a pair-mixing op inside stops it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fx_fastprefill
from fx_fastprefill.passes.split_regions import REDUCED, assign_regions

DIM, HEADS, HEAD_DIM, EXPERTS, TOP_K, VOCAB = 16, 2, 8, 4, 2, 50


class SortedExperts(nn.Module):
    """Top-k routing; the (row, expert) pairs sorted by expert, each pair through its expert's
    weights, put back in order with the inverse permutation, summed per row."""

    def __init__(self, mix_pairs: bool = False):
        super().__init__()
        self.mix_pairs = mix_pairs
        self.router = nn.Linear(DIM, EXPERTS)
        self.up = nn.Parameter(torch.randn(EXPERTS, 2 * DIM, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * DIM) / DIM ** 0.5)

    def forward(self, h):
        shape = h.shape
        h = h.reshape(-1, DIM)
        weights, experts = self.router(h).softmax(-1).topk(TOP_K)
        ids_sorted, perm = torch.sort(experts.reshape(-1))
        x = h[perm // TOP_K]
        if self.mix_pairs:
            x = x.cumsum(0)  # mixes pairs (and so rows): not row-wise
        x = F.silu(torch.bmm(self.up[ids_sorted], x.unsqueeze(-1)).squeeze(-1))
        x = torch.bmm(self.down[ids_sorted], x.unsqueeze(-1)).squeeze(-1) * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0))
        return x[inverse].view(-1, TOP_K, DIM).sum(1).view(shape)


class MoEShared(nn.Module):
    """Three SDPA layers with MoE feed-forwards; the last layer reads layer 1's K/V."""

    def __init__(self, mix_pairs: bool = False, last_reads_embedding: bool = False):
        super().__init__()
        self.last_reads_embedding = last_reads_embedding
        self.embed, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(3))
        self.moe = nn.ModuleList(SortedExperts(mix_pairs) for _ in range(3))

    def forward(self, ids, keep: int = 1):
        batch = ids.shape[0]
        h = embedding = self.embed(ids)
        kv = None
        for i in range(3):
            q, k, v = self.qkv[i](h).view(batch, -1, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
            kv = (k, v) if i < 2 else kv
            h = h + F.scaled_dot_product_attention(q, *kv, is_causal=True).transpose(1, 2).reshape(h.shape)
            # The last layer's experts may read the embedding, which every row's K/V needs: the
            # dispatch then reads a boundary tensor, gathered for the dispatch's own gather.
            h = h + self.moe[i](embedding if i == 2 and self.last_reads_embedding else h)
        return self.head(h[:, -keep:])


@pytest.mark.parametrize("dynamic, last_reads_embedding", [(False, False), (True, False), (False, True)])
def test_sorted_dispatch_is_row_wise_as_a_block(dynamic, last_reads_embedding):
    torch.manual_seed(0)
    model = MoEShared(last_reads_embedding=last_reads_embedding).eval()
    backend = fx_fastprefill.backend(compiler="eager")
    forward = torch.compile(model, backend=backend, dynamic=dynamic)
    for keep in (1, 3):
        ids = torch.randint(0, VOCAB, (3, 10))
        with torch.no_grad():
            torch.testing.assert_close(forward(ids, keep), model(ids, keep), rtol=1e-5, atol=1e-5)
    report = backend.reports[0]
    assert report.cut, report.reason
    assert report.reduced_layers == ["sdpa_1", "sdpa_2"] and report.eligible_layers == ["sdpa_2"]
    # The reduced region sorts only the logits rows' pairs.
    regions = assign_regions(report.graph)
    sorts = [regions[n] for n in report.graph.graph.nodes if n.target is torch.ops.aten.sort.default]
    assert sorts.count(REDUCED) == 2, sorts  # layers 1 and 2's experts


def test_a_pair_mixing_op_in_the_dispatch_is_a_named_stop():
    torch.manual_seed(0)
    model = MoEShared(mix_pairs=True).eval()
    backend = fx_fastprefill.backend(compiler="eager")
    forward = torch.compile(model, backend=backend, dynamic=True)
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(forward(ids), model(ids), rtol=1e-5, atol=1e-5)
    report = backend.reports[0]
    assert not report.cut
    assert "the experts' sorted dispatch" in report.reason and "cumsum" in report.reason, report.reason


def test_the_pair_count_is_found_in_every_spelling_of_arange():
    """``arange(n)``, ``arange(0, n)`` and ``arange(0, n, 1)`` hold the pair count at their ``end``;
    a start or a step other than 0 and 1 is no count (the dispatch is then not cut)."""
    from fx_fastprefill.passes.sorted_dispatch import _count_path
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    perm, n = graph.placeholder("perm"), graph.placeholder("n")
    spelled = {((aten.arange.default, (n,))): ("args", 0), (aten.arange.start, (0, n)): ("args", 1),
               (aten.arange.start_step, (0, n, 1)): ("args", 1), (aten.arange.start_step, (0, n, 2)): None,
               (aten.arange.start, (1, n)): None}
    for (target, args), path in spelled.items():
        assert _count_path(graph.call_function(target, args), perm) == path, (target, args)
