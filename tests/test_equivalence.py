"""Logits with the backend equal the same model without the pass, on random weights and batches."""

import pytest
import torch

import fx_fastprefill
from fx_fastprefill import SeqChunk
from fx_fastprefill.ops import step_context as steps
from examples.gemma3n import Config, Gemma3nLike
from tests.helpers import random_prompts

TOL = dict(rtol=1e-4, atol=1e-4)


def model():
    torch.manual_seed(1)
    return Gemma3nLike(Config(n_layers=7, pattern=3, num_kv_shared_layers=3, sliding_window=6))


def pair(m, compiler="eager", **kw):
    ref = fx_fastprefill.Runner(m, backend=None, max_model_len=96, **kw)
    backend = fx_fastprefill.backend(compiler=compiler)
    return ref, fx_fastprefill.Runner(m, backend=backend, max_model_len=96, **kw), backend


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_prefill_and_generate_with_chunks(compiler):
    m = model()
    prompts = random_prompts(4, 3, 40, 512, seed=2)
    ref, fast, backend = pair(m, compiler, max_num_tokens=24)
    torch.testing.assert_close(fast.prefill(prompts), ref.prefill(prompts), **TOL)
    assert fast.generate(prompts, 6) == ref.generate(prompts, 6)
    report = backend.reports[0]
    assert report.cut and report.reduced_layers[-3:] == report.eligible_layers
    assert fast.fallbacks["pure decode batch (every row needs logits)"] > 0


def test_single_prompt_and_r_zero_step():
    m = model()
    ref, fast, _ = pair(m, max_num_tokens=64)
    for runner in (ref, fast):
        # a prompt chunk without logits rows (R == 0), then its end, then a decode step
        assert runner.step([SeqChunk(0, list(range(10, 30)), num_logits=0)]).shape[0] == 0
    out = [r.step([SeqChunk(0, list(range(30, 37)))]) for r in (ref, fast)]
    torch.testing.assert_close(out[1], out[0], **TOL)
    assert fast.fallbacks["no logits rows in this step (R == 0): reduced region skipped"] == 1


def test_several_logits_rows_and_prompt_logprobs_mixed_with_decode():
    m = model()
    ref, fast, _ = pair(m, max_num_tokens=64)
    steps = [
        [SeqChunk(0, list(range(1, 15)), 1), SeqChunk(1, list(range(5, 25)), 0)],
        [SeqChunk(0, [7]), SeqChunk(1, list(range(25, 31)), 3), SeqChunk(2, list(range(40, 52)), 12)],
        [SeqChunk(0, [8, 9, 10], 3), SeqChunk(1, [11], 1), SeqChunk(2, list(range(60, 70)), 2)],
    ]
    for chunks in steps:
        torch.testing.assert_close(fast.step(chunks), ref.step(chunks), **TOL)


def test_no_recompilation_across_sizes():
    """T from 1 up, R from 1 up (R == 0 is covered above): one compiled graph through the Runner."""
    m = model()
    ref, fast, backend = pair(m, max_num_tokens=64)
    shapes = [(20, 2), (33, 3), (1, 1), (40, 4), (17, 2), (50, 5), (12, 3), (2, 1), (61, 6), (8, 2), (3, 3)]
    for i, (t, r) in enumerate(shapes):
        lengths = [t // r] * (r - 1) + [t - (t // r) * (r - 1)]
        chunks = [SeqChunk(100 * i + j, list(range(1, n + 1))) for j, n in enumerate(lengths)]
        torch.testing.assert_close(fast.step(chunks), ref.step(chunks), **TOL)
        for c in chunks:
            fast.free(c.seq_id)
            ref.free(c.seq_id)
    assert len(backend.reports) == 1


def test_hand_split_model_matches():
    """The hand-split form of the example (the benchmark's hand_split variant) computes the same logits."""
    m = model()
    torch.manual_seed(1)
    split = Gemma3nLike(Config(n_layers=7, pattern=3, num_kv_shared_layers=3, sliding_window=6), hand_split=True)
    split.load_state_dict(m.state_dict())
    prompts = random_prompts(3, 2, 30, 512, seed=5)
    ref = fx_fastprefill.Runner(m, max_num_tokens=24, max_model_len=96)
    hand = fx_fastprefill.Runner(split, max_num_tokens=24, max_model_len=96)
    torch.testing.assert_close(hand.prefill(prompts), ref.prefill(prompts), **TOL)
    assert hand.generate(prompts, 4) == ref.generate(prompts, 4)


def test_the_gate_obeys_the_steps_plan_and_plans_alone_outside_a_step(monkeypatch):
    """The Runner's dispatcher decides the reduced region's mode once per step (StepMetadata.reduced); the gate
    does what it says, and derives the same plan itself only where the step carries none."""
    from fx_fastprefill import fallbacks
    from fx_fastprefill.runtime import step_plan
    m = model()
    prompts = random_prompts(2, 8, 20, 512, seed=3)
    ref, fast, backend = pair(m, max_num_tokens=64)
    expected = ref.prefill(prompts)
    torch.testing.assert_close(fast.prefill(prompts), expected, **TOL)
    assert fast.fallbacks.get(fallbacks.NOT_SMALLER, 0) == 0
    # A plan of all rows for a prefill step the gate alone would run on its logits rows.
    forced = steps.ReducedPlan(steps.REDUCED_ALL_ROWS, fallbacks.NOT_SMALLER)
    monkeypatch.setattr(step_plan, "reduced_region_plan", lambda *args: forced)
    torch.testing.assert_close(fast.prefill(prompts), expected, **TOL)
    assert fast.fallbacks[fallbacks.NOT_SMALLER] == 1


@pytest.mark.parametrize("case, plan", [
    (dict(padded_rows=0), steps.REDUCED_SKIP),
    (dict(num_logits=0), steps.REDUCED_SKIP),
    (dict(has_prefill=False), steps.REDUCED_ALL_ROWS),
    (dict(padded_rows=8), steps.REDUCED_ALL_ROWS),  # padded R == T
    (dict(step=None), steps.REDUCED_ALL_ROWS),
    (dict(), steps.REDUCED_LOGITS_ROWS),
])
def test_the_reduced_region_plan_at_its_boundaries(case, plan):
    fields = dict(num_logits=2, has_prefill=True)
    fields.update({k: v for k, v in case.items() if k in fields})
    step = steps.StepMetadata(query_start=[0, 8], context_lens=[0], slot_base=[0], kv_cache=None, **fields)
    got = steps.plan_reduced_region(case.get("step", step), case.get("padded_rows", 2), 8)
    assert got.mode == plan and (got.fallback is None) == (plan == steps.REDUCED_LOGITS_ROWS)
