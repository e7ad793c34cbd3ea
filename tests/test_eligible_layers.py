"""The seed review's five cases for the trailing run of KV-sharing layers."""

from types import SimpleNamespace

from fx_fastprefill.passes.attention_nodes import AttentionNode
from fx_fastprefill.passes.eligible_layers import eligible_layers


def layers(*spec):
    return [AttentionNode(SimpleNamespace(), name, src, None) for name, src in spec]


def test_no_sharing():
    assert eligible_layers(layers(("a", None), ("b", None))) == []


def test_yoco_tail():
    assert eligible_layers(layers(("a", None), ("b", None), ("c", "b"), ("d", "b"))) == ["c", "d"]


def test_run_broken_by_non_sharing_layer():
    assert eligible_layers(layers(("a", None), ("b", "a"), ("c", None), ("d", "c"))) == ["d"]


def test_draft_layers_skipped_without_breaking_the_run():
    spec = layers(("a", None), ("b", "a"), ("c", "a"), ("draft.0", None), ("draft.1", None))
    assert eligible_layers(spec, draft_layers=["draft.0", "draft.1"]) == ["b", "c"]
    # the same draft layers, not declared, end the run
    assert eligible_layers(spec) == []


def test_switch_off():
    assert eligible_layers(layers(("a", None), ("b", "a")), enabled=False) == []
