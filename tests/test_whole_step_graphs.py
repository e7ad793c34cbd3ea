"""Whole-step CUDA graphs (runtime/whole_step_graphs.py): steps whose every row needs logits run as
one recorded graph. On the CPU with the stand-in recorder of tests/helpers.py (a replay reruns the
recorded function on the recorded inputs: only what the input buffer holds may change a result),
against the same model without graphs or the pass; with real CUDA graphs on the GPU."""

from __future__ import annotations

import pytest
import torch

import fx_fastprefill
from fx_fastprefill import SeqChunk
from fx_fastprefill import fallbacks
from fx_fastprefill.ops.kernels.decode import gathered_decode_attention
from fx_fastprefill.ops.kernels.reference import reference_attention
from fx_fastprefill.ops.kv_cache import KVCache
from fx_fastprefill.ops.step_context import DecodeRows, StepMetadata
from tests.helpers import PAD_SIZES, PROMPTS, graphed_runner, make_runner, plain_runner, small_model

def test_decode_steps_replay_whole_step_graphs_and_generate_the_same_tokens():
    want = plain_runner().generate(PROMPTS, 6)
    runner, backend, recorder = graphed_runner()
    assert runner.whole_step_sizes == [2, 4]  # up to the size that holds max_num_seqs rows
    runner.capture(progress=False)
    recorded = len(recorder.graphs)
    warmups = backend.fallbacks[fallbacks.WHOLE_STEP_WARMUP]
    assert runner.generate(PROMPTS, 6) == want
    # The prefill step is cut; every decode step after it replays a recorded whole-step graph.
    assert runner.report.cut
    assert runner.step_counts["whole_step"] == 5 and runner.whole_step_graphs.replays == 5
    assert backend.fallbacks[fallbacks.WHOLE_STEP_WARMUP] == warmups  # capture() recorded every size
    assert len(recorder.graphs) == recorded  # nothing recorded while serving
    assert fallbacks.PURE_DECODE not in backend.fallbacks  # a decode step is not a fallback


def test_warm_up_record_replay_draft_rows_padding_and_mixed_steps():
    """Without capture(): a size warms up, records, then replays. Up to MAX_ROWS_PER_REQUEST rows
    per request, all with logits (verifying draft tokens), pad to a graph's size with padding rows;
    a step of more rows, and a step with prompt rows that need no logits, run piecewise (cut)."""
    plain = plain_runner()
    runner, backend, _ = graphed_runner(whole_step_sizes=[2, 8])
    for r in (plain, runner):
        r.step([SeqChunk(0, PROMPTS[0], 1), SeqChunk(1, PROMPTS[1], 1)])
    steps = [[SeqChunk(0, [3]), SeqChunk(1, [4])] for _ in range(3)]                            # warm, record, replay
    steps += [[SeqChunk(0, [7, 8, 9], 3), SeqChunk(1, [10], 1), SeqChunk(2, PROMPTS[2][:2], 2)]] * 2  # 6 of 8 rows
    steps += [[SeqChunk(0, [1, 2], 2), SeqChunk(1, [3, 4, 5, 6], 4), SeqChunk(2, [5])]]              # replay
    steps += [[SeqChunk(0, [1, 2, 3], 3), SeqChunk(1, [4, 5, 6, 7], 4), SeqChunk(2, [8, 9], 2)]]      # 9 rows
    for step in steps:
        torch.testing.assert_close(runner.step(step), plain.step(step), rtol=1e-5, atol=1e-5)
    assert backend.fallbacks[fallbacks.WHOLE_STEP_WARMUP] == 2
    assert runner.whole_step_graphs.lifecycle.states == {2: "recorded", 8: "recorded"}
    assert runner.whole_step_graphs.replays == 2 and runner.step_counts["whole_step"] == 6
    assert backend.fallbacks[fallbacks.WHOLE_STEP_TOO_LARGE] == 1
    # A mixed step: the reduced region runs on its logits rows (the gate counts no fallback).
    before, piecewise = dict(backend.fallbacks), runner.step_counts["piecewise"]
    mixed = [SeqChunk(0, [3]), SeqChunk(3, PROMPTS[2], 1)]
    torch.testing.assert_close(runner.step(mixed), plain.step(mixed), rtol=1e-5, atol=1e-5)
    assert runner.report.cut and runner.step_counts["piecewise"] == piecewise + 1
    gate = (fallbacks.PURE_DECODE, fallbacks.NOT_SMALLER, fallbacks.NO_LOGITS_ROWS, fallbacks.NO_STEP_METADATA)
    assert all(backend.fallbacks[r] == before.get(r, 0) for r in gate), dict(backend.fallbacks)


def test_bad_whole_step_sizes():
    with pytest.raises(ValueError, match="whole_step_sizes needs CUDA graphs"):
        make_runner(fx_fastprefill.backend(compiler="eager"), whole_step_sizes=[2])
    with pytest.raises(ValueError, match=r"whole_step_sizes must be ints in \[2, max_num_tokens=64\]"):
        graphed_runner(whole_step_sizes=[1, 4])


@pytest.mark.parametrize("window", [None, 3])
def test_gathered_decode_attention_matches_the_reference(window):
    """The graph-safe decode attention (fixed shapes, metadata on the device) against the reference
    kernel, on a cache of three requests with draft rows and GQA."""
    torch.manual_seed(0)
    cache = KVCache(3, 16, "cpu", torch.float32)
    keys, values = cache.layer_arrays("l0", 2, 8, 8)
    keys.normal_(), values.normal_()
    context, new = [5, 11, 0], [1, 3, 2]
    meta = StepMetadata(query_start=[0, 1, 4, 6], context_lens=context, slot_base=[0, 16, 32], kv_cache=cache,
                        num_logits=6, has_prefill=False)
    q = torch.randn(6, 4, 8)
    want = reference_attention(q, None, None, keys, values, window, 0.3, None, meta)
    positions = torch.tensor([p for c, n in zip(context, new) for p in range(c, c + n)])
    starts = torch.tensor([b for b, n in zip([0, 16, 32], new) for _ in range(n)])
    rows = DecodeRows(slots=starts + positions, key_start=starts.int(), key_len=(positions + 1).int(),
                      position=positions.int())
    got = gathered_decode_attention(q, keys, values, rows, 0.3, window, max_keys=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_whole_step_cuda_graphs_match_the_model_without_graphs():
    def runner(backend, **options):
        return fx_fastprefill.Runner(small_model(), backend=backend, max_num_tokens=64, max_model_len=96,
                                     max_num_seqs=4, device="cuda", dtype=torch.bfloat16, **options)
    plain = runner(fx_fastprefill.backend(fast_prefill=False))
    graphed = runner(fx_fastprefill.backend(cudagraphs=True), token_pad_sizes=PAD_SIZES)
    graphed.capture(progress=False)
    for r in (plain, graphed):
        r.step([SeqChunk(i, p, 1) for i, p in enumerate(PROMPTS)])
    for token in range(6):
        step = [SeqChunk(0, [token + 1]), SeqChunk(1, [token + 2, token + 3], 2), SeqChunk(2, [token + 4])]
        torch.testing.assert_close(graphed.step(step).float(), plain.step(step).float(), rtol=2e-2, atol=2e-2)
    assert graphed.whole_step_graphs.replays == 6
    assert graphed.fallbacks[fallbacks.WHOLE_STEP_RECORD_FAILED] == 0
