"""Attention of a whole-step CUDA graph: every row one query, its metadata in device tensors.

A graph replays the launches it recorded, so nothing here may depend on host values that change
between steps: the number of key splits is fixed by the longest request the cache holds
(``max_keys``, the region length), and each row's key range and position are read on the device.
On CUDA that is the split-KV kernel (split_kv.py); elsewhere (CPU tests, no Triton) a plain
gather of every row's ``max_keys`` slots, masked, in float32.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..step_context import DecodeRows
from .split_kv import decode_split_len


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, rows: DecodeRows, scale: float,
                     sliding_window: int | None, max_keys: int, split_kv_kernel: Callable | None) -> Tensor:
    """``q [P, H, D]``, one query per row, against the cache arrays ``keys, values [slots, Hkv, D]``."""
    if q.shape[0] != rows.position.shape[0]:
        raise ValueError(f"a whole-step graph's attention got {q.shape[0]} query rows for {rows.position.shape[0]} "
                         "rows of step metadata")
    if split_kv_kernel is not None and q.is_cuda:
        split_len = decode_split_len(q.shape[0], keys.shape[1], max_keys)
        return split_kv_kernel(q, keys, values, rows.key_start, rows.key_len, rows.position, scale, sliding_window,
                               max_keys, split_len=split_len)
    return gathered_decode_attention(q, keys, values, rows, scale, sliding_window, max_keys)


def gathered_decode_attention(q: Tensor, keys: Tensor, values: Tensor, rows: DecodeRows, scale: float,
                              sliding_window: int | None, max_keys: int) -> Tensor:
    """The same, with shapes fixed by ``max_keys`` only: ``[P, max_keys]`` slots gathered and masked."""
    offsets = torch.arange(max_keys, device=q.device)
    slots = (rows.key_start.long()[:, None] + offsets[None]).clamp(max=keys.shape[0] - 1)
    position = rows.position.long()[:, None]
    allowed = (offsets[None] < rows.key_len.long()[:, None]) & (offsets[None] <= position)
    if sliding_window is not None:
        allowed &= offsets[None] > position - sliding_window
    group = q.shape[1] // keys.shape[1]
    k = keys[slots].float().repeat_interleave(group, dim=2)    # [P, max_keys, H, D]
    v = values[slots].float().repeat_interleave(group, dim=2)
    scores = torch.einsum("phd,pkhd->phk", q.float(), k) * scale
    probs = scores.masked_fill(~allowed[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("phk,pkhd->phd", probs, v).to(q.dtype)
