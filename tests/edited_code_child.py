"""One process of tests/test_precompiled.py's edited-code restart: ``compile_for_generate(precompile=FOLDER)``
on models whose code lives in a folder of the user's (USER_DIR, on ``sys.path``), greedy ``generate``
compared with the same model uncompiled; prints per model what its prefill loaded and compiled, as JSON.

The models, in this order (the first process also builds a Llama first, built only):
- ``plain``: transformers' Gemma 4, unedited: a warm process loads it before building anything else
  (its saved guards must not depend on which classes the process that saved it had built);
- ``subclass``: a Gemma 4 subclass in ``user_model.py`` whose ``forward`` the test edits;
- ``helper``: a subclass (``user_helper_caller.py``) whose ``forward`` calls ``user_helpers.adjust``,
  a file the test edits (the class's own file unchanged: only the traced code says the function is
  stale);
- ``copy``: Gemma 4 from ``gemma4_copy/modeling_gemma4.py``, a copy of transformers' modeling file
  in a package whose version the edit leaves unchanged.

    python -m tests.edited_code_child FOLDER USER_DIR [--other-class-first]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch


def build(name: str) -> torch.nn.Module:
    from examples import hf_gemma4
    if name == "plain":
        return hf_gemma4.smallest()
    if name == "copy":
        cls = importlib.import_module("gemma4_copy.modeling_gemma4").Gemma4ForCausalLM
    else:
        module, cls = {"subclass": ("user_model", "Edited"), "helper": ("user_helper_caller", "CallsAHelper")}[name]
        cls = getattr(importlib.import_module(module), cls)
    return hf_gemma4.without_hand_slicing(cls(hf_gemma4.config(**hf_gemma4.SMALLEST)).eval())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("user_dir")
    parser.add_argument("--other-class-first", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, args.user_dir)
    import fx_fastprefill
    if args.other_class_first:
        from transformers import LlamaConfig, LlamaForCausalLM
        LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
    result = {}
    for name in ("plain", "subclass", "helper", "copy"):
        torch.manual_seed(0)
        model, reference = build(name), build(name)
        reference.load_state_dict(model.state_dict())
        # A DynamicCache: the decode runs uncompiled, the prefill is the one path precompiled.
        fx_fastprefill.compile_for_generate(model, precompile=args.folder, compiler="eager",
                                            cache_implementation="dynamic")
        ids = torch.randint(3, model.config.vocab_size, (1, 11))
        greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **greedy)
            expected = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **greedy)
        handle, prefill = model.fx_fastprefill, model.fx_fastprefill.forward.precompiled["prefill"]
        result[name] = {"equal": torch.equal(tokens, expected), "tokens": tokens.tolist(),
                        "loaded": prefill.loaded, "compiled": prefill.compiled, "failed": prefill.failed,
                        "cut": [r.cut for r in handle.reports], "fallbacks": dict(handle.backend.fallbacks)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
