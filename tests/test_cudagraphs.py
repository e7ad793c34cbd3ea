"""Piecewise CUDA graphs: step padding (CPU) and replays equal to the model without graphs (GPU)."""

from __future__ import annotations

import pytest
import torch

import fx_fastprefill
from fx_fastprefill import SeqChunk, fallbacks
from fx_fastprefill.runner import default_token_pad_sizes
from examples.gemma3n import Config, Gemma3nLike

STEPS = [
    [SeqChunk(0, list(range(1, 15)), 1), SeqChunk(1, list(range(5, 25)), 0)],
    [SeqChunk(0, [7]), SeqChunk(1, list(range(25, 31)), 3), SeqChunk(2, list(range(40, 52)), 2)],
    [SeqChunk(0, [8, 9, 10], 3), SeqChunk(1, [11], 1), SeqChunk(2, list(range(60, 63)), 1)],
    [SeqChunk(0, [12]), SeqChunk(1, [13]), SeqChunk(2, [14])],
    [SeqChunk(0, [15])],
]


def model():
    torch.manual_seed(5)
    return Gemma3nLike(Config(n_layers=7, pattern=3, num_kv_shared_layers=3, sliding_window=5))


def run(backend, device="cpu", dtype=torch.float32, capture=False, **options):
    runner = fx_fastprefill.Runner(model(), backend=backend, max_num_tokens=64, max_model_len=96, device=device,
                                   dtype=dtype, **options)
    if capture:
        runner.capture(progress=False)
    return runner, [runner.step(chunks) for chunks in STEPS]


def test_default_sizes_pad_little():
    sizes = default_token_pad_sizes(8192)
    assert sizes[:3] == [2, 4, 8] and sizes[-1] == 8192 and 512 in sizes and 1024 in sizes
    assert all(b - a <= 512 for a, b in zip(sizes, sizes[1:]))


def test_padded_steps_give_the_same_logits():
    # Padding rows belong to a request of their own: the real rows' logits must not change.
    _, plain = run(fx_fastprefill.backend(compiler="eager"))
    runner, padded = run(fx_fastprefill.backend(compiler="eager"), token_pad_sizes=[16, 48, 64])
    for p, q in zip(plain, padded):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)
    assert runner.report.cut


def test_bad_pad_sizes_and_seq_ids():
    with pytest.raises(ValueError, match="token_pad_sizes must be ints in"):
        fx_fastprefill.Runner(model(), backend=fx_fastprefill.backend(compiler="eager"), max_num_tokens=8,
                              token_pad_sizes=[4, 16])
    with pytest.raises(ValueError, match="token_pad_sizes needs a compiled model"):
        fx_fastprefill.Runner(model(), max_num_tokens=8, token_pad_sizes=[4])
    runner = fx_fastprefill.Runner(model(), max_num_tokens=8)
    with pytest.raises(ValueError, match="seq_id must be a non-negative int"):
        runner.step([SeqChunk(-1, [1, 2])])
    with pytest.raises(ValueError, match="cudagraphs=True needs compiler='inductor'"):
        fx_fastprefill.backend(cudagraphs=True, compiler="eager")


def test_cudagraphs_on_the_cpu_fall_back_with_a_reason():
    backend = fx_fastprefill.backend(cudagraphs=True)
    runner = fx_fastprefill.Runner(model(), backend=backend, max_num_tokens=16, max_model_len=32,
                                   token_pad_sizes=[4, 16])
    runner.step([SeqChunk(0, [1, 2, 3])])
    assert backend.fallbacks[fallbacks.CUDAGRAPHS_NOT_CUDA] == 1 and not runner.report.cudagraphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudagraph_replays_match_the_model_without_graphs():
    from torch._dynamo.utils import counters
    _, reference = run(fx_fastprefill.backend(), "cuda", torch.bfloat16)
    counters.clear()
    runner, replayed = run(fx_fastprefill.backend(cudagraphs=True), "cuda", torch.bfloat16, capture=True,
                           token_pad_sizes=[2, 4, 8, 16, 32, 64])
    assert runner.report.cudagraphs and runner.report.cut
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    for r, g in zip(reference, replayed):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)
