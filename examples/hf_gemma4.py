"""transformers' Gemma4ForCausalLM, unmodified, through the fx_fastprefill backend.

A small config with random weights (no download): 12 layers, the last 6 reading the K/V of earlier
layers. transformers 5.23 slices the KV-shared layers' inputs by hand; ``tiny()`` switches that off,
so the pass finds the cut itself from the graph's dataflow.

    python examples/hf_gemma4.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.hf_check import main  # noqa: E402


def config(**overrides):
    from transformers import Gemma4TextConfig
    layers = overrides.pop("num_hidden_layers", 12)
    values = dict(vocab_size=256, vocab_size_per_layer_input=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  global_head_dim=32, hidden_size_per_layer_input=8, num_kv_shared_layers=6, sliding_window=8)
    values.update(overrides)
    return Gemma4TextConfig(**values)


def without_hand_slicing(model):
    """Switch off transformers' own slicing of the KV-shared layers' inputs (where it has one)."""
    inner = model.model
    if hasattr(inner, "_maybe_slice_kv_shared_inputs"):
        inner._maybe_slice_kv_shared_inputs = lambda hidden, per_layer, pos, masks, *args, **kwargs: (
            hidden,
            per_layer,
            pos,
            masks,
        )
    return model


def tiny(hand_slicing: bool = False, **overrides):
    """A small Gemma4ForCausalLM with random weights (the explain command's factory)."""
    from transformers import Gemma4ForCausalLM
    model = Gemma4ForCausalLM(config(**overrides)).eval()
    return model if hand_slicing else without_hand_slicing(model)


# The smallest config with both layer types on each side of the sharing boundary (for the tests).
SMALLEST = dict(
    num_hidden_layers=5,
    num_kv_shared_layers=2,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)


def smallest():
    """``tiny`` at the SMALLEST config (the explain test's factory: quick to trace)."""
    return tiny(**SMALLEST)


def shared_layers(cfg) -> list[str]:
    """The attention modules the config says read another layer's K/V."""
    return [f"model.layers.{i}.self_attn" for i, mode in enumerate(cfg.kv_sharing_modes) if mode == "reuse"]


if __name__ == "__main__":
    main(tiny, __doc__)
