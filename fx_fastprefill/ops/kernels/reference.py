"""The reference (CPU) implementation of the attention op: plain, per request, in float32.

Queries may be a subset of the batch rows (``query_rows``): the query-subset form used in the
reduced region. A query keeps its original position, so causal masking is bottom-right aligned with
respect to the request's keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..step_context import WHOLE_STEP, StepMetadata, to_device


def _query_selection(step: StepMetadata, query_rows: Tensor | None, num_q: int, device) -> tuple[Tensor, Tensor]:
    """For each query: the request it belongs to and its absolute position."""
    starts = step.tensor("query_start", device)
    if query_rows is None:
        if num_q != step.num_tokens:
            raise ValueError(f"attention got {num_q} query rows but the step has {step.num_tokens} tokens")
        rows = torch.arange(num_q, device=device)
    else:
        rows = query_rows.to(device=device, dtype=torch.int64)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= step.num_tokens):
            raise IndexError(f"query_rows out of range [0, {step.num_tokens})")
    seq = torch.bucketize(rows, starts[1:], right=True)
    position = step.tensor("context_lens", device)[seq] + rows - starts[seq]
    return seq, position


def _new_slots(step: StepMetadata, device) -> Tensor:
    """The cache slots of this step's rows, built once per step (every layer writes the same slots)."""
    if not step.num_seqs:
        return torch.empty(0, dtype=torch.int64, device=device)
    return step.cached(f"new_slots@{device}", lambda: to_device(torch.cat([
        torch.arange(step.slot_base[i] + step.context_lens[i],
                     step.slot_base[i] + step.context_lens[i] + step.query_start[i + 1] - step.query_start[i])
        for i in range(step.num_seqs)
    ]), device))


def write_kv_rows(k: Tensor, v: Tensor, layer: str, step: StepMetadata) -> None:
    """Store this step's K/V rows of ``layer`` at their slots."""
    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"write_kv(layer={layer!r}): k and v must be [tokens, kv_heads, head_dim], got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    if k.shape[0] != step.num_tokens:
        raise ValueError(
            f"write_kv(layer={layer!r}): k has {k.shape[0]} rows but the step has {step.num_tokens} tokens"
        )
    keys, values = step.kv_cache.layer_arrays(layer, k.shape[1], k.shape[2], v.shape[2])
    slots = step.decode_rows.slots if step.graph_mode == WHOLE_STEP else _new_slots(step, keys.device)
    keys[slots] = k.to(keys.dtype)
    values[slots] = v.to(values.dtype)
    step.kv_cache.last_write_step[layer] = step.step_id


def prepare_kv(q: Tensor, k: Tensor | None, v: Tensor | None, layer: str, kv_source: str | None,
               kv_written: bool, step: StepMetadata) -> tuple[Tensor | None, Tensor | None]:
    """Checks, the eager form's own cache write, and the cache arrays the call reads (None when
    it needs none: no cached prefix and its K/V in hand).

    ``kv_written``: this step's rows were already written by a write_kv node (the compiled form);
    the call then reads earlier steps' keys from the cache and this step's from ``k, v``."""
    cache = step.kv_cache
    num_tokens = step.num_tokens
    if k is not None and k.shape[0] != num_tokens:
        raise ValueError(f"attention(layer={layer!r}): k has {k.shape[0]} rows but the step has {num_tokens} tokens")
    cache_layer = kv_source or layer
    if kv_source is None and not kv_written:
        write_kv_rows(k, v, layer, step)  # eager form: the call writes its own cache
    if k is None and cache.last_write_step.get(kv_source) != step.step_id:
        raise RuntimeError(
            f"attention layer {layer!r} reads kv_source={kv_source!r}, which has not written its cache in this "
            "step: a KV-sharing layer must run after its source layer"
        )
    if not (k is None or step.graph_mode == WHOLE_STEP or any(c > 0 for c in step.context_lens)):
        return None, None
    keys, values = cache.source_arrays(cache_layer, layer)
    if q.shape[1] % keys.shape[1] != 0 or q.shape[2] != keys.shape[2]:
        raise ValueError(
            f"attention layer {layer!r} has q of {q.shape[1]} heads x {q.shape[2]} but the cache it reads "
            f"({cache_layer!r}) holds {keys.shape[1]} heads x {keys.shape[2]}"
        )
    return keys, values


def reference_attention(q: Tensor, k: Tensor | None, v: Tensor | None, keys: Tensor | None, values: Tensor | None,
                        sliding_window: int | None, scale: float | None, query_rows: Tensor | None,
                        step: StepMetadata) -> Tensor:
    """Per request, in float32; ``keys, values`` are the cache arrays from :func:`prepare_kv`."""
    new_k, new_v = k, v

    seq_of_query, query_pos = _query_selection(step, query_rows, q.shape[0], q.device)
    head_dim = q.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    v_head_dim = v.shape[2] if v is not None else values.shape[2]
    out = q.new_zeros(q.shape[0], q.shape[1], v_head_dim)
    for i in range(step.num_seqs):
        chosen = (seq_of_query == i).nonzero().flatten()
        if chosen.numel() == 0:
            continue
        ctx, base = step.context_lens[i], step.slot_base[i]
        lo, hi = step.query_start[i], step.query_start[i + 1]
        if new_k is None:
            seq_k = keys[base: base + ctx + hi - lo]
            seq_v = values[base: base + ctx + hi - lo]
        else:
            seq_k = torch.cat([keys[base: base + ctx].to(new_k.dtype), new_k[lo:hi]]) if ctx else new_k[lo:hi]
            seq_v = torch.cat([values[base: base + ctx].to(new_v.dtype), new_v[lo:hi]]) if ctx else new_v[lo:hi]
        group = q.shape[1] // seq_k.shape[1]
        kf = seq_k.float().repeat_interleave(group, dim=1)
        vf = seq_v.float().repeat_interleave(group, dim=1)
        qf = q[chosen].float()
        scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
        key_pos = torch.arange(seq_k.shape[0], device=q.device)
        pos = query_pos[chosen]
        allowed = key_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            allowed &= key_pos[None, :] > pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[chosen] = torch.einsum("hqk,khd->qhd", probs, vf).to(out.dtype)
    return out
