"""Split-KV attention for few queries against many keys (the query-subset form, and decode).

FlashAttention-2 parallelises over queries; with one query per request a whole SM walks 8192 keys
alone (0.31 ms on the H200, far from the memory bound). Here each (query, KV head, key split) is
one program that reads its share of the keys once for every query head of its GQA group, keeps a
running max / sum / output, and a second pass merges the splits (flash-decoding).

Masking per query: keys of its own request only, ``key <= position`` and, with a window ``w``,
``key > position - w``. Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU wheel of torch comes without Triton
    triton = None

HAS_TRITON = triton is not None

if triton is not None:

    @triton.jit
    def _split_kv_kernel(q_ptr, k_ptr, v_ptr, key_start_ptr, key_len_ptr, pos_ptr, out_ptr, m_ptr, l_ptr,
                         scale, window, num_splits,
                         stride_qr, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         SPLIT_LEN: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        num_kv_heads = tl.num_programs(1)
        key_start = tl.load(key_start_ptr + row)
        key_len = tl.load(key_len_ptr + row)
        pos = tl.load(pos_ptr + row)
        block = split  # the key block this program reads: with a window, counted from the window's first block
        if HAS_WINDOW:
            block += tl.maximum(pos - window + 1, 0) // SPLIT_LEN
        lo = block * SPLIT_LEN
        hi = tl.minimum(lo + SPLIT_LEN, tl.minimum(key_len, pos + 1))
        if HAS_WINDOW:
            lo = tl.maximum(lo, pos - window + 1)
        heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
        head_ok = tl.arange(0, GROUP_PAD) < GROUP
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + row * stride_qr + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None], other=0.0
        )
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        # A fixed trip count; a block outside [lo, hi) is skipped: a split past a request's keys (a
        # decode graph sizes its splits for the longest request) loads nothing and stores no output.
        base = block * SPLIT_LEN
        for offset in range(0, SPLIT_LEN, BLOCK_N):
            if (base + offset < hi) & (base + offset + BLOCK_N > lo):
                keys = base + offset + tl.arange(0, BLOCK_N)
                key_ok = (keys >= lo) & (keys < hi)
                offs = (key_start + keys).to(tl.int64)[:, None]  # slot x stride passes 2**31 in large caches
                # K/V cast to the queries' dtype per block (a cache may be stored in another): no copy of the cache.
                k_at = k_ptr + offs * stride_kn + kv_head * stride_kh + dims[None, :]
                v_at = v_ptr + offs * stride_vn + kv_head * stride_vh + dims[None, :]
                k = tl.load(k_at, mask=key_ok[:, None], other=0.0).to(q.dtype)
                v = tl.load(v_at, mask=key_ok[:, None], other=0.0).to(q.dtype)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
                s = tl.where(key_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m - m_safe)
                l = l * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
                m = m_new
        at = (row * num_kv_heads * GROUP + heads) * num_splits + split
        tl.store(out_ptr + at[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None] & (hi > lo))
        tl.store(m_ptr + at, m, mask=head_ok)
        tl.store(l_ptr + at, l, mask=head_ok)

    @triton.jit
    def _merge_kernel(part_ptr, m_ptr, l_ptr, out_ptr, num_splits,
                      SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        """One program per (row, head): rescale each split by exp(m_split - m_max) and normalise."""
        pid = tl.program_id(0)
        splits = tl.arange(0, SPLITS_PAD)
        ok = splits < num_splits
        dims = tl.arange(0, HEAD_DIM)
        m = tl.load(m_ptr + pid * num_splits + splits, mask=ok, other=float("-inf"))
        l = tl.load(l_ptr + pid * num_splits + splits, mask=ok, other=0.0)
        m_max = tl.max(m, 0)
        weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
        part = tl.load(  # a split without keys stored no partial output: not read
            part_ptr + (pid * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
            mask=(ok & (m > float("-inf")))[:, None], other=0.0
        )
        out = tl.sum(part * weight[:, None], 0) / tl.sum(l * weight, 0)
        tl.store(out_ptr + pid * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def dot_precision(dtype: torch.dtype) -> str:
    """How the kernel's products use the tensor cores: for float32 inputs, full float32 ("ieee")
    unless the user allowed TF32 (``torch.set_float32_matmul_precision("high")``), as torch's own
    matmuls and FlexAttention do (Triton's default is TF32: a 10-bit mantissa). Half-precision
    inputs: Triton's default, unchanged."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def split_kv_attention(q: Tensor, k: Tensor, v: Tensor, key_start: Tensor, key_len: Tensor, position: Tensor,
                       scale: float, sliding_window: int | None, max_keys: int, split_len: int = 512,
                       block_n: int = 64) -> Tensor:
    """``q [R, H, D]``; query ``r`` reads keys ``k[key_start[r] : key_start[r] + key_len[r]]`` of
    ``k, v [N, Hkv, D]`` and sits at ``position[r]`` among them; ``max_keys >= max(key_len)``, known
    on the host; ``split_len`` keys per program (a multiple of ``block_n``). Returns ``[R, H, D]``."""
    if triton is None:
        raise RuntimeError("split_kv_attention needs Triton")
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # Host-side sizes only: reading key_len back would stall the host until the GPU catches up.
    num_splits = max(1, math.ceil(max_keys / split_len))
    if sliding_window is not None:  # a query's window spans at most this many blocks
        num_splits = min(num_splits, math.ceil((sliding_window + split_len - 1) / split_len))
    out = torch.empty(rows, heads, head_dim, device=q.device, dtype=q.dtype)
    if not rows:
        return out
    partial = torch.empty(rows, heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
    m = torch.empty(rows, heads, num_splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    _split_kv_kernel[(rows, kv_heads, num_splits)](
        q, k, v, key_start, key_len, position, partial, m, l,
        scale, sliding_window or 0, num_splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        SPLIT_LEN=split_len, BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype))
    _merge_kernel[(rows * heads,)](partial, m, l, out, num_splits,
                                   SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim)
    return out


def decode_split_len(rows: int, kv_heads: int, max_keys: int, programs: int = 2048) -> int:
    """Keys per program for a whole-step graph, whose splits cover ``max_keys`` whatever the
    requests' lengths: about ``programs`` programs at full length, one request's keys spread over
    many of them when the batch is small (at least 64 keys each, at most 512)."""
    wanted = max_keys * rows * kv_heads // programs
    return min(512, max(64, 1 << max(wanted - 1, 1).bit_length()))
