"""Unmodified transformers models (Gemma 3n, Gemma 4) through the backend, on the CPU in float32:
what the report says about them, and the outputs that keep the graph whole. Correctness across
architectures and the ways of compiling is the model zoo's (tests/test_model_zoo.py).

Each model is built from a small config with random weights and compiled as a module, with static
shapes (``torch.compile(model, backend=...)``: the cheapest compile); the pass must find the KV
sharing from the graph's dataflow and keep transformers' own output.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import fx_fastprefill  # noqa: E402
from examples import hf_gemma3n, hf_gemma4  # noqa: E402
from examples.hf_check import check_prefill, left_padded_batch  # noqa: E402
from fx_fastprefill.passes.split_regions import FULL, REDUCED  # noqa: E402
from tests.helpers import products_of  # noqa: E402

MODELS = {"gemma3n": hf_gemma3n}
if hasattr(transformers, "Gemma4ForCausalLM"):
    MODELS["gemma4"] = hf_gemma4
# The tests that need one model take the one that traces fastest.
QUICKEST = MODELS.get("gemma4", hf_gemma3n)


class Compiled:
    """One model, one backend, the model compiled as a module."""

    def __init__(self, example, **build):
        torch.manual_seed(0)
        self.model = example.tiny(**example.SMALLEST, **build)
        self.config = self.model.config
        self.shared = example.shared_layers(self.config)
        self.backend = fx_fastprefill.backend(compiler="eager")
        torch._dynamo.reset()
        self.forward = torch.compile(self.model, backend=self.backend)

    def batch(self, lengths, seed=0):
        return left_padded_batch(lengths, self.config.vocab_size, pad_id=0, seed=seed)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_report_names_the_shared_layers_their_sources_and_the_narrowed_inputs(name):
    compiled = Compiled(MODELS[name])
    ids, mask = compiled.batch([23, 17])
    assert check_prefill(compiled.model, compiled.forward, ids, mask) <= 1e-5
    report = compiled.backend.reports[-1]
    assert report.cut, report.reason
    assert report.eligible_layers == compiled.shared
    names = [a.layer for a in report.attention_layers]
    assert names == [f"model.layers.{i}.self_attn" for i in range(compiled.config.num_hidden_layers)]
    # Every sharing layer reads a layer of the same type that computes its own K/V.
    by_name = {a.layer: a for a in report.attention_layers}
    types = compiled.config.layer_types
    for layer in compiled.shared:
        source = by_name[layer].kv_source
        assert source is not None and by_name[source].kv_source is None
        assert types[int(source.split(".")[2])] == types[int(layer.split(".")[2])]
    # The cut reaches the last K/V-producing layer's queries: one layer more than the sharing run.
    assert report.reduced_layers[1:] == compiled.shared
    assert report.prompt_len == 23  # static shapes: the FLOPs estimate at the graph's own length
    assert 0.2 < report.flops_removed_fraction < 0.9
    # The per-layer inputs [B, S, layers, width]: the reduced layers' slices are computed on R rows.
    first_reduced = int(report.reduced_layers[0].split(".")[2])
    assert [(n.dim, n.full, n.reduced) for n in report.narrowed] == [
        (2, [0, first_reduced], [first_reduced, compiled.config.num_hidden_layers])]
    # ...through the norm that reads the projection twice, up to the projection itself.
    projections = products_of(report, "model.per_layer_model_projection.weight")
    assert sorted(region for region, _ in projections) == sorted([FULL, REDUCED])


@pytest.mark.parametrize("kwargs, reason", [
    ({"output_hidden_states": True}, "hidden states or attentions asked for"),
    ({"logits_to_keep": 0}, "logits for all rows were asked for"),
    ({"logits_to_keep": 30}, "keeps every row in this graph: logits_to_keep=30 is not less than"),
])
def test_outputs_that_need_every_row_leave_the_graph_unchanged(kwargs, reason):
    compiled = Compiled(QUICKEST)
    ids, mask = compiled.batch([12, 7], seed=2)
    call = dict(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
    call.update(kwargs)
    with torch.no_grad():
        expected = compiled.model(**call)
        got = compiled.forward(**call)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    [report] = compiled.backend.reports
    assert not report.cut and reason in report.reason, report.reason


@pytest.mark.slow
@pytest.mark.parametrize("keep", [2, 30])
def test_dynamic_logits_to_keep_beyond_the_prompt_is_not_cut_and_right(keep):
    """Gemma 4 (its own slicing of the shared inputs), dynamic=True, k > T: transformers' slice keeps
    min(k, T) rows, so there is nothing to cut to. A plain reason, no internal error."""
    torch.manual_seed(0)
    model = hf_gemma4.tiny(**hf_gemma4.SMALLEST) if "gemma4" in MODELS else hf_gemma3n.tiny(**hf_gemma3n.SMALLEST)
    backend = fx_fastprefill.backend(compiler="eager")
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend=backend, dynamic=True)
    ids, mask = left_padded_batch([12, 9], model.config.vocab_size, pad_id=0, seed=4)
    with torch.no_grad():
        for k in (2, keep):  # a first k that Dynamo then makes dynamic, or specializes
            got = forward(input_ids=ids, attention_mask=mask, logits_to_keep=k, use_cache=False).logits
            want = model(input_ids=ids, attention_mask=mask, logits_to_keep=k, use_cache=False).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    report = backend.reports[-1]
    assert report.fallbacks.get(fx_fastprefill.fallbacks.PASS_FAILED) is None
    assert "internal error" not in report.reason
    if keep == 30:
        assert not report.cut and "keeps every row in this graph" in report.reason, report.reason
    else:
        assert report.cut, report.reason


def test_a_graph_break_before_the_logits_slice_is_named():
    """The decoder in one graph, the logits slice in the next: the decoder graph's reason says a
    graph break may have left the row selection elsewhere; the answer stays right."""
    from torch import nn

    class SplitByBreak(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            hidden = self.lm.model(input_ids=ids, use_cache=False).last_hidden_state
            torch._dynamo.graph_break()
            return self.lm.lm_head(hidden[:, -1:])

    torch.manual_seed(0)
    model = SplitByBreak(QUICKEST.tiny(**QUICKEST.SMALLEST)).eval()
    backend = fx_fastprefill.backend(compiler="eager")
    torch._dynamo.reset()
    ids = torch.randint(3, 200, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(ids), model(ids), rtol=1e-5, atol=1e-5)
    decoder = backend.reports[0]
    assert not decoder.cut and "a graph break left the row selection in another graph" in decoder.reason


def test_plain_sdpa_model_with_causal_flag_matches():
    """A hand-written SDPA model (no transformers mask: is_causal=True) keeps its alignment when cut."""
    import torch.nn.functional as F
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)
            self.qkv = nn.ModuleList(nn.Linear(16, 48) for _ in range(3))

        def forward(self, ids):
            h = self.embed(ids)
            kv = None
            for i, proj in enumerate(self.qkv):
                q, k, v = proj(h).view(*h.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
                kv = (k, v) if i < 2 else kv  # the last layer reads the K/V of layer 1
                h = h + F.scaled_dot_product_attention(q, *kv, is_causal=True).transpose(1, 2).reshape(h.shape)
            return self.head(h[:, -2:])

    torch.manual_seed(0)
    model = Tiny().eval()
    backend = fx_fastprefill.backend(compiler="eager")
    forward = torch.compile(model, backend=backend, dynamic=True)
    ids = torch.randint(0, 50, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(forward(ids), model(ids), rtol=1e-5, atol=1e-5)
    report = backend.reports[-1]
    # Calls outside any submodule are named by their order; the cut reaches layer 1's queries.
    assert report.cut and report.eligible_layers == ["sdpa_2"], report.explain()
    assert report.reduced_layers == ["sdpa_1", "sdpa_2"]


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("rows", [[4], [0, 0, -1, 3]], ids=["one-row", "repeated-and-negative"])
def test_logits_to_keep_as_an_index_tensor(dynamic, rows):
    """transformers accepts a 1-D index tensor as logits_to_keep (the same positions of every
    sequence, negative ones from the end, repeats allowed): the cut runs on exactly those rows."""
    torch.manual_seed(0)
    model = QUICKEST.tiny(**QUICKEST.SMALLEST)
    backend = fx_fastprefill.backend(compiler="eager")
    torch._dynamo.reset()
    forward = torch.compile(model.forward if dynamic else model, backend=backend, dynamic=dynamic)
    ids, mask = left_padded_batch([11, 8], model.config.vocab_size, pad_id=0, seed=1)
    keep = torch.tensor(rows)
    with torch.no_grad():
        got = forward(input_ids=ids, attention_mask=mask, logits_to_keep=keep, use_cache=False).logits
        want = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep, use_cache=False).logits
    assert got.shape == want.shape == (2, len(rows), model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    report = backend.reports[-1]
    assert report.cut and "index tensor" in report.row_selection, report.reason


@pytest.mark.skipif(not hasattr(transformers, "MistralLarge4ForConditionalGeneration"),
                    reason="this transformers has no Mistral Large 4")
@pytest.mark.parametrize("pattern, reduced", [("FFSS", [1, 2, 3]), ("FFFS", [2, 3]), ("FFFF", [3])])
def test_cla_style_latent_sharing_is_found_from_the_dataflow(pattern, reduced):
    """Mistral Large 4's ``kv_source_layers``: layers 2 and 3 make their own K/V from layer 1's latent,
    so no tensor is shared past views; the report names them as sharing layer 1's K/V from the
    dataflow alone. A layer whose indexer reads the previous layer's output on every row keeps that
    layer on every row, and the report says so."""
    from examples.hf_zoo import ARCHITECTURES, _mistral_large4
    assert "mistral_large4" in ARCHITECTURES
    torch.manual_seed(0)
    model = _mistral_large4(pattern)()
    backend = fx_fastprefill.backend(compiler="eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    ids, mask = left_padded_batch([9, 12], model.config.text_config.vocab_size, pad_id=0, seed=3)
    assert check_prefill(model, compiled, ids, mask) <= 1e-5
    report = backend.reports[-1]
    layer = "model.language_model.layers.{}.self_attn".format
    assert {a.layer: a.kv_source for a in report.attention_layers} == {
        layer(0): None, layer(1): None, layer(2): layer(1), layer(3): layer(1)}
    assert report.eligible_layers == [layer(2), layer(3)]
    assert report.reduced_layers == [layer(i) for i in reduced]
    summary = report.summary()
    assert f"KV-sharing layers (reading an earlier layer's K/V): {layer(2)} <- {layer(1)}" in summary
    if pattern == "FFFF":
        assert list(report.unreduced) == [layer(2)]
        assert "layers.3.self_attn.indexer" in report.unreduced[layer(2)]
        assert f"not reduced: {layer(2)}: its output reaches" in summary
    else:
        assert report.unreduced == {}
