"""The attention op on variable-length kernels: FlashAttention-2 varlen on CUDA.

The kernel (``aten._flash_attention_forward``, in torch 2.11 and 2.13) takes packed queries and
keys with cumulative offsets, native GQA, a left window, and aligns causal masking bottom-right
when a sequence has fewer queries than keys: exactly the query-subset form, where a request's
logits rows are a suffix of its rows. This file builds that packing from the step metadata; the
kernel is a parameter so the packing is tested on the CPU against the reference with an emulation
(:func:`emulated_varlen_kernel`) that follows the kernel's documented semantics.

Keys come from the graph (this step's K/V) when no request has a cached prefix, else from the
cache, where ``write_kv`` has already stored this step's rows next to the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ... import torch_seams
from ..step_context import StepMetadata, to_device

# Requests with at most this many queries go to the split-KV kernel (split_kv.py), short
# key ranges too: alone, FlashAttention's query-subset form was faster at 512 keys (probe run 2),
# but inside Gemma 4 at 1x8192 sending those calls to it made the step 4% slower (BENCHMARKS.md, run 6).
SPLIT_KV_MAX_QUERIES = 4

Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, float, int | None], Tensor]


@dataclass
class VarlenPacking:
    """What one attention call's kernel reads; built once per step and form, and only for the
    kernel the call uses."""
    max_q: int
    max_k: int
    num_real_queries: int         # queries past this are padding copies of the last real one
    from_cache: bool              # keys are read from the cache (a cached prefix, or a sharing layer without K/V)
    split_kv: bool                # the split-KV kernel takes the call (few queries per request)
    # The varlen kernel's view: cumulative query and key counts, and the cache slots to gather.
    cu_q: Tensor | None = None    # int32 [n + 1]
    cu_k: Tensor | None = None    # int32 [n + 1]
    key_slots: Tensor | None = None  # int64 [sum k], when from_cache
    # The split-KV kernel's view, per query: where its request's keys start (in this step's rows, or
    # its first cache slot: a request's slots are contiguous, read in place), how many there are,
    # and the query's position among them.
    query_key_start: Tensor | None = None
    query_key_len: Tensor | None = None
    query_position: Tensor | None = None


def packing(step: StepMetadata, query_rows: Tensor | None, device, keys_from_cache: bool = False,
            split_kv_available: bool = False) -> VarlenPacking | None:
    """The packing of one attention call; None when the call's query rows are not known on the host."""
    n = step.num_seqs
    new = [step.query_start[i + 1] - step.query_start[i] for i in range(n)]
    if query_rows is None or query_rows.shape[0] == step.num_tokens:
        per_seq_q = new  # every row (also the full-rows path of the reduced region: rows = arange(T))
    elif step.logits_rows is not None:
        per_seq_q = [0] * n
        for row in step.logits_rows:
            per_seq_q[_request_of(step, row)] += 1
    else:
        return None
    cached = keys_from_cache or any(c > 0 for c in step.context_lens)
    split_kv = split_kv_available and max(per_seq_q, default=0) <= SPLIT_KV_MAX_QUERIES
    key = ("varlen", tuple(per_seq_q), cached, split_kv, str(device))
    return step.cached(key, lambda: _pack(step, per_seq_q, new, cached, split_kv, device))


def _pack(step: StepMetadata, per_seq_q: list[int], new: list[int], cached: bool, split_kv: bool,
          device) -> "VarlenPacking":
    """The packing of one step's batch for the varlen kernels (built once per step)."""
    per_seq_k = [c + m for c, m in zip(step.context_lens, new)]
    pack = VarlenPacking(max(per_seq_q, default=0), max(per_seq_k, default=0), sum(per_seq_q), cached, split_kv)
    if split_kv:
        starts, lengths, positions = [], [], []
        offset = 0
        for nq, nk, base in zip(per_seq_q, per_seq_k, step.slot_base):
            starts += [base if cached else offset] * nq
            lengths += [nk] * nq
            positions += list(range(nk - nq, nk))  # a request's queries are the suffix of its keys
            offset += nk
        pack.query_key_start, pack.query_key_len, pack.query_position = (
            to_device(torch.tensor(x, dtype=torch.int32), device) for x in (starts, lengths, positions))
    else:
        pack.cu_q = to_device(torch.tensor([0] + _cumsum(per_seq_q), dtype=torch.int32), device)
        pack.cu_k = to_device(torch.tensor([0] + _cumsum(per_seq_k), dtype=torch.int32), device)
        if cached:
            pack.key_slots = to_device(
                torch.cat([torch.arange(b, b + k) for b, k in zip(step.slot_base, per_seq_k)]), device
            )
    return pack


def _request_of(step: StepMetadata, row: int) -> int:
    for i in range(step.num_seqs):
        if step.query_start[i] <= row < step.query_start[i + 1]:
            return i
    raise IndexError(f"logits row {row} is outside the step's {step.num_tokens} rows")


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def varlen_attention(
    q: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    keys_cache: Tensor | None,
    values_cache: Tensor | None,
    sliding_window: int | None,
    scale: float | None,
    query_rows: Tensor | None,
    step: StepMetadata,
    kernel: Kernel,
    split_kv_kernel: Callable | None = None,
) -> Tensor | None:
    """``q [Tq, H, D]`` against this step's ``k, v`` or the cache; None when the packing is unknown.

    ``split_kv_kernel`` (when given) takes calls whose requests have at most
    ``SPLIT_KV_MAX_QUERIES`` queries each: the logits rows of a prefill, and decode."""
    # A sharing layer called without its source's rows (eager, or a hand-split model) reads the cache.
    pack = packing(
        step, query_rows, q.device, keys_from_cache=k is None, split_kv_available=split_kv_kernel is not None
    )
    if pack is None:
        return None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    real = q[: pack.num_real_queries]
    if pack.split_kv:
        keys, values = (keys_cache, values_cache) if pack.from_cache else (k, v)  # the cache read in place
        out = split_kv_kernel(real, keys, values, pack.query_key_start, pack.query_key_len, pack.query_position,
                              scale, sliding_window, pack.max_k)
    else:
        keys, values = k, v
        if pack.from_cache:  # the varlen kernel takes packed keys: gather the requests' slots
            keys, values = keys_cache[pack.key_slots].to(q.dtype), values_cache[pack.key_slots].to(q.dtype)
        out = kernel(real, keys, values, pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, scale, sliding_window)
    if pack.num_real_queries < q.shape[0]:  # padded rows repeat the last real row; their results are dropped
        out = torch.cat([out, out[-1:].expand(q.shape[0] - pack.num_real_queries, *out.shape[1:])])
    return out


def flash_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, sliding_window):
    """FlashAttention-2 varlen through aten (CUDA, fp16 / bf16)."""
    left = -1 if sliding_window is None else sliding_window - 1
    return torch_seams.flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
        window_size_left=left, window_size_right=0)[0]


def emulated_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, sliding_window):
    """What the flash kernel computes, in plain float32: per sequence, queries aligned bottom-right."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    group = q.shape[1] // k.shape[1]
    for i in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        if q1 == q0:
            continue
        qs, ks = q[q0:q1].float(), k[k0:k1].float().repeat_interleave(group, 1)
        vs = v[k0:k1].float().repeat_interleave(group, 1)
        pos = torch.arange(q1 - q0) + (k1 - k0) - (q1 - q0)
        key_pos = torch.arange(k1 - k0)
        allowed = key_pos[None] <= pos[:, None]
        if sliding_window is not None:
            allowed &= key_pos[None] > pos[:, None] - sliding_window
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed[None], float("-inf")).softmax(-1), vs).to(
            out.dtype
        )
    return out


def flash_supported(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
