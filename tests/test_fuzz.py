"""Differential fuzzing: random model structures x random batches, with and without the pass.

Profiles: ``ci`` (the default, bounded to about two minutes) and ``long`` (by hand:
``HYPOTHESIS_PROFILE=long pytest tests/test_fuzz.py``). Every example builds a fresh model, runs
the same random steps through a Runner without the pass and one with it, and requires the same
logits, one compiled graph for every step, and a report that agrees with the model's structure.
"""

from __future__ import annotations

import os
import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fx_fastprefill
from fx_fastprefill import SeqChunk
from tests.fuzz_models import FuzzModel, LayerSpec, ModelSpec

settings.register_profile("ci", max_examples=5, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

MAX_TOKENS, MAX_LEN, MAX_SEQS = 32, 48, 4
TOL = dict(rtol=1e-4, atol=1e-4)


@st.composite
def model_specs(draw) -> tuple[ModelSpec, tuple[str, ...]]:
    n = draw(st.integers(2, 6))
    layers: list[LayerSpec] = []
    for i in range(n):
        own = [j for j, layer in enumerate(layers) if layer.kv_source is None]
        source = draw(st.sampled_from(own)) if own and draw(st.booleans()) else None
        kv_heads = layers[source].kv_heads if source is not None else draw(st.sampled_from([1, 2]))
        layers.append(LayerSpec(source, kv_heads, draw(st.sampled_from([1, 2])),
                                draw(st.one_of(st.none(), st.integers(1, 6)))))
    mixing = draw(st.dictionaries(st.integers(0, n - 1), st.sampled_from(["cumsum", "running_mean"]), max_size=1))
    spec = ModelSpec(tuple(layers), draw(st.booleans()), draw(st.booleans()), mixing)
    drafts = tuple(sorted(draw(st.sets(st.sampled_from([f"attn.{i}" for i in range(n)]), max_size=1))))
    return spec, drafts


def random_steps(seed: int, num_steps: int) -> list[list[SeqChunk]]:
    """Mixed steps: new prompts in chunks (cached prefixes), decode rows, 0..all logits rows."""
    rng = random.Random(seed)
    prompts: dict[int, list[int]] = {}
    done: dict[int, int] = {}  # tokens already run
    next_id, steps = 0, []
    for _ in range(num_steps):
        chunks, budget = [], MAX_TOKENS
        active = [s for s in prompts if done[s] < MAX_LEN - 1]
        if len(prompts) < MAX_SEQS and rng.random() < 0.6:
            prompts[next_id] = [rng.randrange(97) for _ in range(rng.randint(1, 30))]
            done[next_id] = 0
            active.append(next_id)
            next_id += 1
        rng.shuffle(active)
        for seq in active[:3]:
            remaining = len(prompts[seq]) - done[seq]
            if remaining > 0:  # a prompt chunk
                n = min(remaining, rng.randint(1, 12), budget)
                tokens = prompts[seq][done[seq]: done[seq] + n]
            else:  # a decode row (or a few speculative rows)
                n = min(rng.choice([1, 1, 1, 3]), budget, MAX_LEN - done[seq])
                tokens = [rng.randrange(97) for _ in range(n)]
            if n <= 0:
                continue
            reaches_end = done[seq] + n >= len(prompts[seq])
            num_logits = (
                rng.choice([1, 1, n, rng.randint(0, n)]) if reaches_end else rng.choice([0, 0, rng.randint(0, n)])
            )
            chunks.append(SeqChunk(seq, tokens, min(num_logits, n)))
            done[seq] += n
            budget -= n
        if chunks:
            steps.append(chunks)
        for seq in [s for s in prompts if done[s] >= MAX_LEN - 3]:
            steps.append(("free", seq))
            del prompts[seq], done[seq]
    return steps


def expected_eligible(spec: ModelSpec, drafts: tuple[str, ...]) -> list[str]:
    run = []
    for i in reversed(range(len(spec.layers))):
        if f"attn.{i}" in drafts:
            continue
        if spec.layers[i].kv_source is None:
            break
        run.append(f"attn.{i}")
    return run[::-1]


@given(model_specs(), st.integers(0, 2**16))
def test_random_models_and_batches_match_the_model_without_the_pass(spec_and_drafts, seed):
    spec, drafts = spec_and_drafts
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = FuzzModel(spec)
    common = dict(max_num_tokens=MAX_TOKENS, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS)
    ref = fx_fastprefill.Runner(model, **common)
    backend = fx_fastprefill.backend(compiler="eager", draft_layers=drafts)
    fast = fx_fastprefill.Runner(model, backend=backend, **common)
    for step in random_steps(seed, 8):
        if isinstance(step, tuple):
            ref.free(step[1])
            fast.free(step[1])
            continue
        torch.testing.assert_close(fast.step(step), ref.step(step), **TOL)
    assert len(backend.reports) == 1, "a step recompiled"
    report = backend.reports[0]
    assert report.eligible_layers == expected_eligible(spec, drafts)
    reduced = [int(name.split(".")[1]) for name in report.reduced_layers]
    assert reduced == list(range(len(spec.layers) - len(reduced), len(spec.layers)))
    for at in spec.mixing:  # a row-mixing op after layer `at` stops the hoist there
        assert all(i > at for i in reduced), (spec.mixing, report.reduced_layers)
    if report.cut:
        assert reduced, report
        # Eligible layers after the last layer with its own K/V (a draft one too) and after the
        # last row-mixing op are all reduced.
        own = [i for i, layer in enumerate(spec.layers) if layer.kv_source is None]
        boundary = max([max(own)] + list(spec.mixing))
        expected = {name for name in report.eligible_layers if int(name.split(".")[1]) > boundary}
        assert expected <= set(report.reduced_layers), (expected, report.reduced_layers)
    else:
        assert "stopped before any attention layer" in report.reason
