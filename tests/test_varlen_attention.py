"""The varlen (FlashAttention) path of the attention op: its packing, tested on the CPU with an
emulation of the kernel, and the real kernel on a GPU."""

import pytest
import torch

import fx_fastprefill
from fx_fastprefill import SeqChunk, attention_op
from fx_fastprefill.varlen_attention import emulated_varlen_kernel
from examples.gemma3n import Config, Gemma3nLike

STEPS = [
    [SeqChunk(0, list(range(1, 15)), 1), SeqChunk(1, list(range(5, 25)), 0)],          # fresh prompts
    [SeqChunk(0, [7]), SeqChunk(1, list(range(25, 31)), 3), SeqChunk(2, list(range(40, 52)), 12)],  # cached prefixes
    [SeqChunk(0, [8, 9, 10], 3), SeqChunk(1, [11], 1), SeqChunk(2, list(range(60, 70)), 2)],
    [SeqChunk(0, [12]), SeqChunk(1, [13]), SeqChunk(2, [14])],                           # pure decode
]


def run(model, backend, steps, device="cpu", dtype=torch.float32):
    runner = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=64, max_model_len=96, device=device, dtype=dtype)
    return [runner.step(chunks) for chunks in steps]


def model():
    torch.manual_seed(3)
    return Gemma3nLike(Config(n_layers=7, pattern=3, num_kv_shared_layers=3, sliding_window=5))


@pytest.mark.parametrize("compiled", [False, True])
def test_packing_matches_the_reference_with_an_emulated_kernel(monkeypatch, compiled):
    m = model()
    expected = run(m, None, STEPS)
    calls = []

    def kernel(*args):
        calls.append(args[4].shape[0])
        return emulated_varlen_kernel(*args)

    monkeypatch.setattr(attention_op, "flash_supported", lambda q: True)
    monkeypatch.setattr(attention_op, "flash_varlen_kernel", kernel)
    backend = fx_fastprefill.backend(compiler="eager") if compiled else None
    got = run(m, backend, STEPS)
    assert calls, "the varlen path never ran"
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_kernel_on_the_gpu_matches_the_reference(monkeypatch):
    m = model()
    fast = run(m, fx_fastprefill.backend(compiler="eager"), STEPS, "cuda", torch.bfloat16)
    monkeypatch.setattr(attention_op, "flash_supported", lambda q: False)
    slow = run(m, fx_fastprefill.backend(compiler="eager"), STEPS, "cuda", torch.bfloat16)
    for f, s in zip(fast, slow):
        torch.testing.assert_close(f.float(), s.float(), rtol=3e-2, atol=3e-2)
