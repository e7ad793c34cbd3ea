"""One compiled graph for every step size, and no more memory than without the pass."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fx_fastprefill
from fx_fastprefill import SeqChunk
from examples.gemma3n import Config, Gemma3nLike

TOL = dict(rtol=1e-4, atol=1e-4)


def small_model():
    torch.manual_seed(0)
    return Gemma3nLike(Config(n_layers=6, pattern=3, num_kv_shared_layers=2, sliding_window=4))


def test_no_recompilation_for_any_token_count_and_logits_rows():
    """T from 1 to max_num_tokens, R from 0 to T: one graph, counted by the backend's reports."""
    max_tokens = 10
    model = small_model()
    backend = fx_fastprefill.backend(compiler="eager")
    fast = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=max_tokens, max_model_len=16)
    ref = fx_fastprefill.Runner(model, max_num_tokens=max_tokens, max_model_len=16)
    steps = 0
    for t in range(1, max_tokens + 1):
        for r in range(t + 1):
            chunk = [SeqChunk(steps, [(7 * steps + i) % 500 + 1 for i in range(t)], r)]
            torch.testing.assert_close(fast.step(chunk), ref.step(chunk), **TOL)
            fast.free(steps)
            ref.free(steps)
            steps += 1
    assert len(backend.reports) == 1, [r.summary() for r in backend.reports]


def peak_bytes(fn) -> int:
    """Peak of live CPU tensor memory while ``fn`` runs, from the profiler's allocation records."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = [(e.time_range.start, e.cpu_memory_usage) if e.name == "[memory]" else
               (e.time_range.end, e.self_cpu_memory_usage) for e in prof.events()]
    live = peak = 0
    for _, change in sorted(changes):
        live += change
        peak = max(peak, live)
    return peak


@pytest.mark.slow
def test_peak_memory_of_a_prefill_step_is_not_higher_with_the_pass():
    """With Inductor, what users run (its memory planning decides the peak)."""
    model = small_model()
    chunks = [SeqChunk(i, [(13 * i + j) % 500 + 1 for j in range(60)]) for i in range(3)]
    peaks = {}
    for fast_prefill in (True, False):
        runner = fx_fastprefill.Runner(
            model,
            backend=fx_fastprefill.backend(fast_prefill=fast_prefill),
            max_num_tokens=256,
            max_model_len=64,
        )
        runner.step(chunks)  # compile
        for c in chunks:
            runner.free(c.seq_id)
        peaks[fast_prefill] = peak_bytes(lambda: runner.step(chunks))
    assert peaks[False] > 0
    assert peaks[True] <= peaks[False], peaks


@pytest.mark.slow
def test_a_changed_attribute_or_parameter_recompiles_under_cheap_guards():
    """The Runner traces with dict-tag guards and constant floats (fx_fastprefill/dynamo_guards.py);
    setting a float attribute, a config field or a new parameter after compiling must still be seen."""
    model = small_model()
    backend = fx_fastprefill.backend(compiler="eager")
    fast = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=8, max_model_len=16)
    ref = fx_fastprefill.Runner(model, max_num_tokens=8, max_model_len=16)
    changes = [
        lambda: setattr(model.layers[1].mlp_norm, "eps", 0.5),
        lambda: setattr(model.cfg, "softcap", 3.0),
        lambda: setattr(
            model.layers[4].mlp.down, "weight", torch.nn.Parameter(torch.randn_like(model.layers[4].mlp.down.weight))
        ),
    ]
    for seq_id, change in enumerate([None, *changes]):
        if change is not None:
            before = ref.step([SeqChunk(100 + seq_id, [3, 1, 4, 1, 5], 1)])
            ref.free(100 + seq_id)
            change()
        chunk = [SeqChunk(seq_id, [3, 1, 4, 1, 5], 1)]
        expected = ref.step(chunk)
        if change is not None:
            assert not torch.allclose(expected, before), "the change did not alter the eager model's output"
        torch.testing.assert_close(fast.step(chunk), expected, **TOL)
        fast.free(seq_id)
        ref.free(seq_id)
