"""Building one step's batch: token rows, positions, logits rows, and their validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..ops.step_context import to_device


@dataclass
class SeqChunk:
    """The new tokens of one request in one step.

    ``num_logits`` asks for logits of the last ``num_logits`` of these rows: 1 for the last prompt
    token or a decode token, k + 1 to verify k speculative tokens, ``len(tokens)`` for prompt
    logprobs, 0 for a prompt chunk that does not reach the end of its prompt.
    """

    seq_id: int
    tokens: Sequence[int]
    num_logits: int = 1


def default_logits_indices(chunks: Sequence[SeqChunk]) -> list[int]:
    rows, start = [], 0
    for chunk in chunks:
        n = len(chunk.tokens)
        if not 0 <= chunk.num_logits <= n:
            raise ValueError(
                f"request {chunk.seq_id}: num_logits={chunk.num_logits} must lie in [0, {n}] (its number of new tokens)"
            )
        rows.extend(range(start + n - chunk.num_logits, start + n))
        start += n
    return rows


def validate_logits_indices(indices: Sequence[int], chunks: Sequence[SeqChunk]) -> None:
    """Logits rows must be sorted, in range, and a suffix of their request's rows.

    The suffix rule is what makes bottom-right causal alignment exact in the reduced region; sorted
    rows let the output order match the request order.
    """
    ends, start = [], 0
    for chunk in chunks:
        start += len(chunk.tokens)
        ends.append(start)
    total = start
    previous = -1
    for i, row in enumerate(indices):
        if not 0 <= row < total:
            raise IndexError(f"logits_indices[{i}] = {row} is out of range [0, {total}) for this step's {total} tokens")
        if row <= previous:
            raise ValueError(
                f"logits_indices must be strictly increasing: logits_indices[{i}] = {row} follows {previous}"
            )
        previous = row
    row_set = set(indices)
    begin = 0
    for chunk, end in zip(chunks, ends):
        mine = [r for r in indices if begin <= r < end]
        if mine and mine[-1] != end - 1 or any(r not in row_set for r in range(mine[0] if mine else end, end)):
            raise ValueError(
                f"logits rows of request {chunk.seq_id} ({mine}) are not a suffix of its rows [{begin}, {end}): "
                "the rows that need logits must be the last ones of each request"
            )
        begin = end


def pad_to_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (n itself when none is large enough)."""
    for size in buckets:
        if size >= n:
            return size
    return n


def padded_indices(indices: list[int], buckets: Sequence[int], device, num_tokens: int) -> torch.Tensor:
    """Pad logits rows up to a bucket size with the last valid row: padded rows are valid rows
    whose results are discarded, so a reduced batch of any size reuses a captured shape. With no
    logits rows at all (R == 0) and buckets, the smallest bucket of the last token row is passed;
    the step metadata says R == 0 and the reduced region is skipped."""
    if not indices and not buckets:
        return torch.empty(0, dtype=torch.int64, device=device)
    padded = pad_to_bucket(len(indices), buckets)
    out = torch.empty(padded, dtype=torch.int64)
    out[: len(indices)] = torch.tensor(indices, dtype=torch.int64)
    out[len(indices):] = indices[-1] if indices else num_tokens - 1
    return to_device(out, device)
