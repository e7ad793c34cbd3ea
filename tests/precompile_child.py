"""One process of tests/test_precompiled.py: ``compile_for_generate(precompile=FOLDER)`` on the
smallest Gemma 4, greedy ``generate`` on random batches, tokens compared with the model without
the pass; prints what was traced, loaded and compiled as JSON (the last line of stdout).

    python -m tests.precompile_child FOLDER --batches 1,2 [--device cuda] [--decode-backend eager] [--dynamic-cache]
"""

from __future__ import annotations

import argparse
import json
import os

# A tag of the user's own (set in the environment, as Inductor's compile workers see it too): the
# package's programs are keyed with it and their own, their kernels with it alone.
os.environ.setdefault("TORCH_COMPILE_CACHE_KEY_TAG", "a-users-tag")

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--batches", default="1,2")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--decode-backend", default="inductor")
    parser.add_argument("--dynamic-cache", action="store_true", help="then one generate with a DynamicCache passed in")
    parser.add_argument("--weights-seed", type=int, default=0, help="the model's random weights")
    args = parser.parse_args()
    import fx_fastprefill
    from examples import hf_gemma4
    from fx_fastprefill.compilation import compile_graph
    from torch._dynamo.utils import compilation_time_metrics, counters
    # The tag each compiled graph's kernels are reloaded under: Inductor keys their autotuning
    # results with it, so it must be the tag they were compiled and tuned under (the user's).
    reload_tags = []
    reload = compile_graph._reload
    compile_graph._reload = lambda graph: reload_tags.append(torch.compiler.config.cache_key_tag) or reload(graph)
    torch.manual_seed(args.weights_seed)
    # fp32 on either device: greedy tokens are compared, and a random model's logits are close
    # enough together that bf16's rounding alone flips some of them.
    with torch.device(args.device):
        model = hf_gemma4.smallest().eval()
        reference = hf_gemma4.smallest().eval()
    reference.load_state_dict(model.state_dict())
    # The reference runs eager: on CUDA, transformers would compile its static-cache decode itself
    # (other numerics, and graphs counted as if this model's).
    reference.generation_config.disable_compile = True
    fx_fastprefill.compile_for_generate(model, precompile=args.folder, decode_backend=args.decode_backend)
    torch.manual_seed(args.seed)
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    equal = []
    for i, batch in enumerate(int(b) for b in args.batches.split(",")):
        ids = torch.randint(3, model.config.vocab_size, (batch, 9 + 4 * i + args.seed), device=args.device)
        with torch.no_grad():
            tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **greedy)
            expected = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          cache_implementation="static", **greedy)
        equal.append(torch.equal(tokens, expected))
        if i == 0:
            loaded_first = {p: f.loaded for p, f in model.fx_fastprefill.forward.precompiled.items()}
    handle = model.fx_fastprefill
    result = {
        "equal": equal, "graphs": counters["stats"]["unique_graphs"], "compiles": handle.compiles,
        "loaded_by_the_first_generate": loaded_first,
        "loaded": {p: f.loaded for p, f in handle.forward.precompiled.items()},
        "compiled": {p: f.compiled for p, f in handle.forward.precompiled.items()},
        "failed": {p: f.failed for p, f in handle.forward.precompiled.items()},
        "cut": [r.cut for r in handle.reports], "from_cache": [r.from_cache for r in handle.reports],
        "fallbacks": dict(handle.backend.fallbacks), "summary": handle.summary(),
        "reload_tags": sorted(set(reload_tags)),
        # kernels tuned at their first launch (on CUDA): a warm start finds the cold one's results
        "autotuned": len(compilation_time_metrics.get("CachingAutotuner.benchmark_all_configs", [])),
    }
    if args.dynamic_cache:  # a cache from an earlier call: another prefill graph, by guard miss
        from transformers import DynamicCache
        ids = torch.randint(3, model.config.vocab_size, (1, 13), device=args.device)
        with torch.no_grad():
            tokens = model.generate(input_ids=ids, past_key_values=DynamicCache(config=model.config), **greedy)
            expected = reference.generate(input_ids=ids, past_key_values=DynamicCache(config=reference.config),
                                          **greedy)
        result["dynamic_cache"] = {"equal": torch.equal(tokens, expected), "fallbacks": dict(handle.backend.fallbacks),
                                   "compiled": handle.forward.precompiled["prefill"].compiled}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
