"""transformers' Gemma3nForCausalLM, unmodified, through the fx_fastprefill backend.

A small text-only config with random weights (no download): 10 layers, the last 4 reading the
K/V of earlier layers. The pass finds the sharing from the graph's dataflow.

    python examples/hf_gemma3n.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.hf_check import main  # noqa: E402


def config(**overrides):
    from transformers import Gemma3nTextConfig
    layers = overrides.pop("num_hidden_layers", 10)
    values = dict(vocab_size=256, vocab_size_per_layer_input=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  hidden_size_per_layer_input=8, num_kv_shared_layers=4, sliding_window=8,
                  layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * (layers // 5),
                  altup_num_inputs=4, laurel_rank=8, activation_sparsity_pattern=[0.0] * layers)
    values.update(overrides)
    return Gemma3nTextConfig(**values)


def tiny(**overrides):
    """A small Gemma3nForCausalLM with random weights (the explain command's factory)."""
    from transformers import Gemma3nForCausalLM
    return Gemma3nForCausalLM(config(**overrides)).eval()


# The smallest config with both layer types on each side of the sharing boundary (for the tests).
SMALLEST = dict(
    num_hidden_layers=5,
    num_kv_shared_layers=2,
    activation_sparsity_pattern=[0.0] * 5,
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
