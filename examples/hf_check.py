"""Shared driver of the transformers examples: compile an unmodified model with and without the
pass, compare prefill logits (batch of 1, left-padded batch) and greedy generation, print the report."""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Callable

import torch
from torch import nn

import fx_fastprefill

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def left_padded_batch(lengths: list[int], vocab: int, pad_id: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of prompts of the given lengths, padded on the left."""
    rng = random.Random(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.tensor([rng.randrange(3, vocab) for _ in range(n)])
        mask[row, width - n:] = 1
    return ids, mask


def compile_with_pass(model: nn.Module, backend) -> Callable:
    """The model's forward through the backend; dynamic shapes so one graph serves every prompt length."""
    return torch.compile(model.forward, backend=backend, dynamic=True)


@torch.no_grad()
def check_prefill(model: nn.Module, forward: Callable, ids: torch.Tensor, mask: torch.Tensor, **kwargs) -> float:
    """Max relative error of the compiled forward's last-token logits against eager transformers."""
    ref = model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False, **kwargs).logits
    out = forward(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False, **kwargs).logits
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@torch.no_grad()
def greedy(
    model: nn.Module, forward: Callable | None, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    """Greedy generation with the model's own cache; ``forward`` replaces the model's forward while it runs."""
    original = model.forward
    if forward is not None:
        model.forward = forward
    try:
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              min_new_tokens=new_tokens, pad_token_id=0)
    finally:
        model.forward = original


def main(build: Callable[[], nn.Module], doc: str) -> None:
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--compiler", default="eager", choices=["inductor", "eager"],
                        help="how the cut regions are compiled (eager: fast to build)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build().eval()
    vocab = model.config.get_text_config().vocab_size
    backend = fx_fastprefill.backend(compiler=args.compiler, prompt_len=4096)
    forward = compile_with_pass(model, backend)
    start = time.perf_counter()
    errors = {}
    for name, lengths in (("1 prompt of 24 tokens", [24]), ("3 prompts of 9, 20, 14 tokens, left-padded", [9, 20, 14])):
        ids, mask = left_padded_batch(lengths, vocab, pad_id=0)
        errors[name] = check_prefill(model, forward, ids, mask)
    prefill_report = backend.reports[-1]
    ids, mask = left_padded_batch([11, 7], vocab, pad_id=0, seed=1)
    same_tokens = torch.equal(
        greedy(model, None, ids, mask, args.new_tokens), greedy(model, forward, ids, mask, args.new_tokens)
    )
    elapsed = time.perf_counter() - start

    print(
        f"{type(model).__name__}: "
        f"{model.config.num_hidden_layers if hasattr(model.config, 'num_hidden_layers') else ''} layers, "
        f"random weights, float32 on the CPU\n"
    )
    print(prefill_report.explain())
    print()
    for name, error in errors.items():
        print(f"last-token logits, {name}: max relative error {error:.1e} against eager transformers (tolerance 1e-5)")
    print(f"greedy generation of {args.new_tokens} tokens with the model's cache, 2 prompts: identical: {same_tokens}")
    print(f"graphs compiled: {len(backend.reports)} (cut: {sum(r.cut for r in backend.reports)}); {elapsed:.1f} s")
    for r in backend.reports:
        if not r.cut:
            print(f"  a graph left unchanged: {r.reason}")
    if max(errors.values()) > 1e-5 or not same_tokens:
        raise SystemExit("MISMATCH: the pass changed the model's output")
