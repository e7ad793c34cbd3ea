"""passes/narrow_sliced_producers.py: a tensor the regions read in disjoint slices is computed in two
narrower parts, the reduced region's part on the logits rows only; and it is left alone otherwise."""

import pytest
import torch

import fx_fastprefill
from fx_fastprefill.passes.split_regions import FULL, REDUCED
from examples.gemma3n import Config, Gemma3nLike
from tests.helpers import products_of

aten = torch.ops.aten
TOL = dict(rtol=1e-4, atol=1e-4)


def compiled_report(model, prompts, **options):
    backend = fx_fastprefill.backend(compiler="eager", prompt_len=64, **options)
    fast = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=64, max_model_len=64)
    ref = fx_fastprefill.Runner(model, max_num_tokens=64, max_model_len=64)
    torch.testing.assert_close(fast.prefill(prompts), ref.prefill(prompts), **TOL)
    return backend.reports[0]


def test_per_layer_inputs_split_at_the_sharing_boundary():
    torch.manual_seed(0)
    cfg = Config(n_layers=6, pattern=3, num_kv_shared_layers=2, sliding_window=4, per_layer_dim=8)
    model = Gemma3nLike(cfg)
    prompts = [torch.randint(1, cfg.vocab_size, (n,)).tolist() for n in (17, 9, 30)]
    report = compiled_report(model, prompts)
    first_reduced = int(report.reduced_layers[0].split(".")[1])
    [narrowed] = report.narrowed
    assert (narrowed.dim, narrowed.full, narrowed.reduced) == (1, [0, first_reduced], [first_reduced, cfg.n_layers])
    # The projection's rows for the reduced layers are multiplied in the reduced region (R rows), the
    # others in the full region (T rows); nothing computes every column for every row any more.
    p = cfg.per_layer_dim
    assert sorted(products_of(report, "per_layer_from_hidden.weight")) == sorted(
        [(FULL, (0, first_reduced * p)), (REDUCED, (first_reduced * p, cfg.n_layers * p))])
    assert report.flops_removed_fraction > 0


def test_narrow_slices_false_keeps_the_projection_whole():
    """The option that turns the pass off (to measure or bisect it): still cut, still matching, and
    the projection computes every layer's columns for every row in the full region."""
    torch.manual_seed(0)
    cfg = Config(n_layers=6, pattern=3, num_kv_shared_layers=2, sliding_window=4, per_layer_dim=8)
    prompts = [torch.randint(1, cfg.vocab_size, (n,)).tolist() for n in (17, 9)]
    on = compiled_report(Gemma3nLike(cfg), prompts)
    off = compiled_report(Gemma3nLike(cfg), prompts, narrow_slices=False)
    assert off.cut and off.reduced_layers == on.reduced_layers and off.narrowed == []
    assert products_of(off, "per_layer_from_hidden.weight") == [(FULL, None)]
    assert off.flops_removed_fraction < on.flops_removed_fraction
    with pytest.raises(TypeError, match="narrow_slices must be a bool"):
        fx_fastprefill.backend(narrow_slices="no")


class OverlappingReads(Gemma3nLike):
    """Every layer reads one of the first two per-layer slices: the reduced region reads slices the
    full region reads too, so nothing may be split."""

    def forward(self, input_ids, positions, logits_indices):
        cfg = self.cfg
        h = self.embed(input_ids) * cfg.dim ** 0.5
        per_layer = (self.per_layer_embed(input_ids) + self.per_layer_from_hidden(h)).view(
            -1, cfg.n_layers, cfg.per_layer_dim
        )
        streams = torch.cat([h[None], self.stream_up(h).view(-1, cfg.num_streams - 1, cfg.dim).transpose(0, 1)])
        for i, layer in enumerate(self.layers):
            streams = layer(streams, per_layer[:, i % 2], positions)
        logits = self.head(self.norm(streams.mean(0)[logits_indices]))
        return torch.tanh(logits / cfg.softcap) * cfg.softcap


def test_no_split_when_the_regions_read_overlapping_slices():
    torch.manual_seed(0)
    report = compiled_report(OverlappingReads(Config(n_layers=6, pattern=3, num_kv_shared_layers=2, sliding_window=4)),
                             [[1, 2, 3, 4, 5, 6], [7, 8, 9]])
    assert report.cut and report.reduced_layers and report.narrowed == []


def test_a_producer_with_another_reader_is_sliced_not_recomputed():
    """The embedding output ``h`` also feeds the streams: the split must not compute the per-layer
    projection's input twice, and the model still matches."""
    torch.manual_seed(1)
    cfg = Config(n_layers=4, pattern=2, num_kv_shared_layers=2, sliding_window=3)
    model = Gemma3nLike(cfg)
    report = compiled_report(model, [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]])
    embeddings = [n for n in report.graph.graph.nodes if n.target is aten.embedding.default
                  and report.placeholder_names.get(n.args[0]) == "embed.weight"]
    assert len(embeddings) == 1 and len(report.narrowed) == 1
