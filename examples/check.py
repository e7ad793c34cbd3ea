"""Shared driver of the example scripts: build, run with and without the pass, compare, report."""

from __future__ import annotations

import argparse
import random
import time

import torch

import fx_fastprefill


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def main(model_cls, presets: dict, doc: str) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(presets))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(5, 40), metavar=("MIN", "MAX"))
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument(
        "--max-num-tokens", type=int, default=32, help="token budget of one step (longer prompts are chunked)"
    )
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--cudagraphs", action="store_true",
                        help="piecewise CUDA graphs (on CUDA): every step size is recorded before the first step")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = presets[args.preset]
    torch.manual_seed(0)
    model = model_cls(cfg)
    prompts = random_prompts(args.prompts, tuple(args.prompt_len), cfg.vocab_size)
    max_model_len = max(map(len, prompts)) + args.new_tokens
    common = dict(max_num_tokens=args.max_num_tokens, max_model_len=max_model_len, device=args.device, dtype=dtype)

    reference = fx_fastprefill.Runner(model, backend=None, **common)
    start = time.perf_counter()
    ref_logits = reference.prefill(prompts)
    ref_tokens = reference.generate(prompts, args.new_tokens)
    backend = fx_fastprefill.backend(
        compiler=args.compiler, prompt_len=max(map(len, prompts)), cudagraphs=args.cudagraphs
    )
    fast = fx_fastprefill.Runner(model, backend=backend, **common)
    if args.cudagraphs:
        fast.capture()
    logits = fast.prefill(prompts)
    tokens = fast.generate(prompts, args.new_tokens)
    elapsed = time.perf_counter() - start

    print(f"{model_cls.__name__} ({args.preset}, {args.dtype}, {args.device}): {len(prompts)} prompts of "
          f"{[len(p) for p in prompts]} tokens, steps of at most {args.max_num_tokens} tokens\n")
    print(fast.report.summary())
    error = ((logits.float() - ref_logits.float()).abs().max() / ref_logits.float().abs().max()).item()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    print(
        f"\nlast-token logits vs the same model without the pass: max relative error {error:.2e} (tolerance "
        f"{tolerance:g})"
    )
    print(f"greedy tokens identical: {tokens == ref_tokens}")
    print(f"compiled graphs: {len(backend.reports)}; fallbacks: {dict(fast.fallbacks) or 'none'}; {elapsed:.1f} s")
    if error > tolerance or tokens != ref_tokens:
        raise SystemExit("MISMATCH: the pass changed the model's output")
