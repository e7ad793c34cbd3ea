"""The varlen (FlashAttention) path of the attention op: its packing, tested on the CPU with an
emulation of the kernel, and the real kernel on a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fx_fastprefill
from fx_fastprefill import SeqChunk
from fx_fastprefill.ops.attention import use_kernels
from fx_fastprefill.ops.kernels.split_kv import split_kv_attention
from fx_fastprefill.ops.kernels.varlen import emulated_varlen_kernel
from examples.gemma3n import Config, Gemma3nLike

ROOT = Path(__file__).resolve().parents[1]

STEPS = [
    [SeqChunk(0, list(range(1, 15)), 1), SeqChunk(1, list(range(5, 25)), 0)],          # fresh prompts
    [SeqChunk(0, [7]), SeqChunk(1, list(range(25, 31)), 3), SeqChunk(2, list(range(40, 52)), 12)],  # cached prefixes
    [SeqChunk(0, [8, 9, 10], 3), SeqChunk(1, [11], 1), SeqChunk(2, list(range(60, 70)), 2)],
    [SeqChunk(0, [12]), SeqChunk(1, [13]), SeqChunk(2, [14])],                           # pure decode
]


def run(model, backend, steps, device="cpu", dtype=torch.float32):
    runner = fx_fastprefill.Runner(
        model, backend=backend, max_num_tokens=64, max_model_len=96, device=device, dtype=dtype
    )
    return [runner.step(chunks) for chunks in steps]


def model():
    torch.manual_seed(3)
    return Gemma3nLike(Config(n_layers=7, pattern=3, num_kv_shared_layers=3, sliding_window=5))


def compare(compiled: bool, split_kv: bool) -> dict:
    """Runs STEPS through the varlen path (FlashAttention emulated; the split-KV kernel real, on
    the CPU under TRITON_INTERPRET=1, when ``split_kv``) and checks them against the reference.
    Returns how many attention calls went to each kernel."""
    m = model()
    expected = run(m, None, STEPS)
    calls = {"flash": 0, "split_kv": 0}

    def flash(*args):
        calls["flash"] += 1
        return emulated_varlen_kernel(*args)

    def split(*args):
        calls["split_kv"] += 1
        return split_kv_attention(*args, split_len=16, block_n=16)

    backend = fx_fastprefill.backend(compiler="eager") if compiled else None
    with use_kernels(varlen=flash, split_kv=split if split_kv else None, varlen_supported=lambda q: True):
        got = run(m, backend, STEPS)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    return calls


@pytest.mark.parametrize("compiled", [False, True])
def test_packing_matches_the_reference_with_an_emulated_kernel(compiled):
    calls = compare(compiled, False)
    assert calls["flash"] > 0 and calls["split_kv"] == 0


def split_kv_against_float64(seed: int = 0, device: str = "cpu") -> float:
    """Random rows of random lengths, windows that straddle key blocks, GQA group 4: the split-KV
    kernel and its merge against a float64 reference. Returns the largest relative error."""
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for window, kv_dtype in ((None, torch.float32), (5, torch.float32), (16, torch.float16), (23, torch.float32)):
        lens = torch.randint(1, 90, (6,), generator=gen)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)[:-1]])
        pos = torch.stack([torch.randint(0, int(n), (1,), generator=gen)[0] for n in lens])
        q = torch.randn(6, 8, 16, generator=gen)
        # One case stores K/V in float16: the kernel casts them to the queries' dtype as it reads.
        k, v = (torch.randn(int(lens.sum()), 2, 16, generator=gen).to(kv_dtype) for _ in range(2))
        on = [t.to(device) for t in (q, k, v, starts.int(), lens.int(), pos.int())]
        # Splits sized for the longest row, and for 3x that (a decode graph's: most splits empty).
        got, slack = (split_kv_attention(*on, 0.25, window, n * int(lens.max()), split_len=16, block_n=16).cpu()
                      for n in (1, 3))
        torch.testing.assert_close(slack, got, rtol=1e-6, atol=1e-6)
        for r in range(6):
            keys = torch.arange(int(lens[r]))
            ok = keys <= pos[r] if window is None else (keys <= pos[r]) & (keys > pos[r] - window)
            kr = k[starts[r]: starts[r] + lens[r]].double().repeat_interleave(4, 1)
            vr = v[starts[r]: starts[r] + lens[r]].double().repeat_interleave(4, 1)
            scores = torch.einsum("hd,khd->hk", q[r].double(), kr) * 0.25
            ref = torch.einsum("hk,khd->hd", scores.masked_fill(~ok[None], float("-inf")).softmax(-1), vr)
            worst = max(worst, float((got[r].double() - ref).norm() / ref.norm()))
    return worst


@pytest.mark.slow
def test_split_kv_kernel_in_the_triton_interpreter():
    """The real split-KV kernel, interpreted (one subprocess: Triton reads TRITON_INTERPRET at
    import): the logits and decode rows of every step against the reference, then random rows
    against float64, with splits sized for the longest row and for 3x that."""
    pytest.importorskip("triton")
    script = ("from tests.test_varlen_attention import compare, split_kv_against_float64 as f; "
              "calls = compare(True, True); assert calls['split_kv'] > 0 and calls['flash'] > 0, calls; "
              "print(max(f(s) for s in range(2)))")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split()[-1]) < 1e-5  # float32 kernel arithmetic


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_split_kv_kernel_on_the_gpu_matches_float64():
    """float32 products in full precision by default (as torch's matmuls); TF32 where the user
    allows it (ops/kernels/split_kv.py: dot_precision)."""
    assert max(split_kv_against_float64(seed, "cuda") for seed in range(3)) < 1e-5
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert max(split_kv_against_float64(seed, "cuda") for seed in range(3)) < 5e-3  # tf32 dots
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_kernel_on_the_gpu_matches_the_reference():
    m = model()
    fast = run(m, fx_fastprefill.backend(compiler="eager"), STEPS, "cuda", torch.bfloat16)
    with use_kernels(varlen_supported=lambda q: False):
        slow = run(m, fx_fastprefill.backend(compiler="eager"), STEPS, "cuda", torch.bfloat16)
    for f, s in zip(fast, slow):
        torch.testing.assert_close(f.float(), s.float(), rtol=3e-2, atol=3e-2)
