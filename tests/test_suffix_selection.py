"""The suffix form of the row selection (``hidden[:, -k:]``, transformers' ``logits_to_keep``) on
small SDPA models: several rows of several sequences, and fused projections split into Q, K, V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fx_fastprefill

DIM, HEADS, HEAD_DIM = 16, 2, 8


class SeparateProjections(nn.Module):
    """Three SDPA layers, the last reading layer 1's K/V; queries projected from the hidden state
    viewed ``[B * S, D]``, keys and values from it seq-first: the region's query path reads the
    gathered ``[B, k, D]`` through a view."""

    def __init__(self, keep: int):
        super().__init__()
        self.keep = keep
        self.embed, self.head = nn.Embedding(50, DIM), nn.Linear(DIM, 50)
        self.q = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.kv = nn.ModuleList(nn.Linear(DIM, 2 * DIM) for _ in range(3))

    def forward(self, ids):
        batch, seq = ids.shape
        h = self.embed(ids)
        kv = None
        for i in range(3):
            q = self.q[i](h.view(-1, DIM)).view(batch, -1, HEADS, HEAD_DIM).transpose(1, 2)
            k, v = self.kv[i](h.transpose(0, 1)).transpose(0, 1).reshape(batch, -1, 2, HEADS, HEAD_DIM).permute(
                2, 0, 3, 1, 4)
            kv = (k, v) if i < 2 else kv
            h = h + F.scaled_dot_product_attention(q, *kv, is_causal=True).transpose(1, 2).reshape(h.shape)
        return self.head(h[:, -self.keep:])


class SharedKV(nn.Module):
    """Three SDPA layers, the last reading layer 1's K/V. ``fused``: one projection chunked into
    Q, K, V (GPT-NeoX style: the chunk's K and V outputs are needed for all rows)."""

    def __init__(self, keep: int, fused: bool):
        super().__init__()
        self.keep, self.fused = keep, fused
        self.embed, self.head = nn.Embedding(50, DIM), nn.Linear(DIM, 50)
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(3))

    def forward(self, ids):
        batch, seq = ids.shape
        h = self.embed(ids)
        kv = None
        for i, proj in enumerate(self.qkv):
            # The hidden state is viewed [B * S, D] before its projection, as transformers' linears do.
            x = proj(h.view(-1, DIM)).view(batch, -1, 3 * DIM)
            if self.fused:
                q, k, v = (t.view(batch, -1, HEADS, HEAD_DIM).transpose(1, 2) for t in x.chunk(3, dim=-1))
            else:
                q, k, v = x.view(batch, -1, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
            kv = (k, v) if i < 2 else kv
            h = h + F.scaled_dot_product_attention(q, *kv, is_causal=True).transpose(1, 2).reshape(h.shape)
        return self.head(h[:, -self.keep:])


@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("fused", [False, True])
def test_last_rows_of_a_batch_match_and_are_cut(keep, fused):
    torch.manual_seed(0)
    model = SharedKV(keep, fused).eval()
    backend = fx_fastprefill.backend(compiler="eager")
    forward = torch.compile(model, backend=backend, dynamic=True)
    for seq in (11, 7):
        ids = torch.randint(0, 50, (3, seq))
        with torch.no_grad():
            torch.testing.assert_close(forward(ids), model(ids), rtol=1e-5, atol=1e-5)
    [report] = backend.reports
    assert report.cut, report.reason
    assert report.reduced_layers == ["sdpa_1", "sdpa_2"] and report.eligible_layers == ["sdpa_2"]
    if fused:  # the chunk's Q output is what the region reads: gathered itself, not the chunk
        assert any("getitem" in g.name for g in report.gathered), report.gathered


def test_several_last_rows_read_through_a_view():
    """``x[:, -k:]`` of a batch is not contiguous; a view in the region needs it contiguous."""
    torch.manual_seed(0)
    model = SeparateProjections(keep=2).eval()
    backend = fx_fastprefill.backend(compiler="eager")
    forward = torch.compile(model, backend=backend, dynamic=True)
    ids = torch.randint(0, 50, (3, 9))
    with torch.no_grad():
        torch.testing.assert_close(forward(ids), model(ids), rtol=1e-5, atol=1e-5)
    [report] = backend.reports
    assert report.cut, report.reason
    assert report.reduced_layers == ["sdpa_1", "sdpa_2"]


class KeepArgument(SharedKV):
    """``keep`` passed at call time, as transformers' ``logits_to_keep``."""

    def forward(self, ids, keep: int):
        self.keep = keep
        return super().forward(ids)


def test_symbolic_k_is_cut_and_k_of_0_and_1_get_their_own_graphs():
    torch.manual_seed(0)
    model = KeepArgument(keep=1, fused=False).eval()
    backend = fx_fastprefill.backend(compiler="eager")
    forward = torch.compile(model, backend=backend, dynamic=True)
    calls = [(11, 3), (7, 2), (9, 5), (8, 1), (10, 0)]
    for seq, keep in calls:
        ids = torch.randint(0, 50, (2, seq))
        with torch.no_grad():
            torch.testing.assert_close(forward(ids, keep), model(ids, keep), rtol=1e-5, atol=1e-5)
    symbolic, one, zero = backend.reports  # k >= 2: one graph; 1 and 0: Dynamo specializes them
    assert symbolic.cut and "k given at run time" in symbolic.row_selection, symbolic.reason
    assert symbolic.reduced_layers == ["sdpa_1", "sdpa_2"]
    assert one.cut and one.row_selection.startswith("the last 1 row of each sequence")
    assert not zero.cut and "logits for all rows were asked for" in zero.reason


@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("fused", [False, True])
def test_static_shapes_are_cut_from_the_first_call(keep, fused):
    """``torch.compile(model, backend=...)`` traces its first call with static shapes: the token dim
    is the one the row selection slices, followed through views by position, not by value. The
    lengths collide with other sizes (16 = the model dim, 8 = the head dim and the batch)."""
    torch.manual_seed(0)
    model = SharedKV(keep, fused).eval()
    backend = fx_fastprefill.backend(compiler="eager")
    forward = torch.compile(model, backend=backend)
    for batch, seq in ((2, DIM), (HEAD_DIM, HEAD_DIM)):
        ids = torch.randint(0, 50, (batch, seq))
        with torch.no_grad():
            torch.testing.assert_close(forward(ids), model(ids), rtol=1e-5, atol=1e-5)
        assert len(backend.reports) == 1 or batch == HEAD_DIM
    static, dynamic = backend.reports  # the second shape: Dynamo's recompile with dynamic sizes
    for report in (static, dynamic):
        assert report.cut, report.reason
        assert report.reduced_layers == ["sdpa_1", "sdpa_2"]
    assert static.prompt_len == DIM  # the FLOPs estimate at the graph's own length
    assert not static.rows_symbol.free_symbols and dynamic.rows_symbol.free_symbols


def test_int_k_made_dynamic_over_static_shapes_is_cut():
    """A second k at the same shape: Dynamo makes k a SymInt and keeps the sizes static."""
    torch.manual_seed(0)
    model = KeepArgument(keep=1, fused=False).eval()
    backend = fx_fastprefill.backend(compiler="eager")
    forward = torch.compile(model, backend=backend)
    ids = torch.randint(0, 50, (2, 11))
    for keep in (3, 2, 4):
        with torch.no_grad():
            torch.testing.assert_close(forward(ids, keep), model(ids, keep), rtol=1e-5, atol=1e-5)
    constant, symbolic = backend.reports
    assert constant.cut and constant.row_selection.startswith("the last 3 rows of each sequence")
    assert symbolic.cut and "k given at run time" in symbolic.row_selection, symbolic.reason
    assert not symbolic.rows_symbol.free_symbols
