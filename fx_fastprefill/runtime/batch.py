"""Building one step's batch: token rows, positions, logits rows, their validation, and the
sizes steps are padded to."""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Iterable, Sequence

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


def padded_indices(indices: list[int], padded: int, device, num_tokens: int) -> torch.Tensor:
    """The logits rows padded up to ``padded`` rows (the step's plan: runtime/step_plan.py) with the
    last valid row: padded rows are valid rows whose results are discarded, so a reduced batch of
    any size reuses a captured shape. With no logits rows at all (R == 0) the last token row is
    passed; the step's plan then skips the reduced region."""
    out = torch.empty(padded, dtype=torch.int64)
    out[: len(indices)] = torch.tensor(indices, dtype=torch.int64)
    out[len(indices):] = indices[-1] if indices else num_tokens - 1
    return to_device(out, device)


def power_of_two_buckets(limit: int) -> list[int]:
    # From 2: Dynamo specializes sizes 0 and 1, so R == 0 and R == 1 are padded to 2 and the
    # one dynamic graph serves them (the real count travels in the step metadata).
    sizes, n = [], 2
    while n < limit:
        sizes.append(n)
        n *= 2
    return sizes + [limit]


def default_token_pad_sizes(limit: int) -> list[int]:
    """Step sizes captured for CUDA graphs: powers of two up to 512, then every multiple of 512
    (a prefill pads by at most 511 rows, under 12% from 4096 rows up), then ``limit``."""
    sizes = [n for n in power_of_two_buckets(min(limit, 512)) if n < limit]
    sizes += list(range(1024, limit, 512))
    return sizes + [limit]


def check_sizes(name: str, sizes: Sequence[int], limit: int) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not all(isinstance(n, int) and 2 <= n <= limit for n in sizes):
        raise ValueError(f"{name} must be ints in [2, max_num_tokens={limit}], got {list(sizes)!r}")
    return sorted(set(sizes))


@dataclass
class Request:
    """A request's state in the Runner (its KV region, tokens computed) and, when the scheduler
    runs it, its prompt and output."""

    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    slot_base: int
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def done(self) -> bool:
        return not self.in_prefill and len(self.output) >= self.max_new_tokens


def in_vocab(token_lists: Iterable[Sequence[int]], vocab_size: int | None) -> bool:
    """Every token an int inside the vocabulary, checked at C speed: one packed copy, one
    min/max (a 32k-token prompt costs ~0.2 ms, not ~2 ms of a Python loop the GPU waits for; a
    decode step of 64 requests checked chunk by chunk cost ~0.7 ms on the H200)."""
    packed = array.array("q")
    try:
        for tokens in token_lists:
            packed.extend(tokens)
    except (TypeError, OverflowError):
        return False
    if not packed or vocab_size is None:
        return True
    low, high = torch.aminmax(torch.frombuffer(packed, dtype=torch.int64))
    return int(low) >= 0 and int(high) < vocab_size


def validate_tokens(seq_label: str, tokens: Sequence[int], vocab_size: int | None) -> None:
    """Every token an int inside the vocabulary; the loop runs only to name the first bad token."""
    if in_vocab([tokens], vocab_size):
        return
    for i, token in enumerate(tokens):
        integer = hasattr(type(token), "__index__")  # what array("q") accepts: int, numpy and 0-d tensor ints
        if not integer or (vocab_size is not None and not 0 <= token < vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "an int"
            raise ValueError(f"{seq_label}: token {i} is {token!r}, outside the vocabulary {bound}")


def validate_step_tokens(chunks: Sequence[SeqChunk], vocab_size: int | None) -> None:
    """Every chunk's tokens checked at once; chunk by chunk only to name the request with a bad token."""
    if not in_vocab((chunk.tokens for chunk in chunks), vocab_size):
        for chunk in chunks:
            validate_tokens(f"request {chunk.seq_id}", chunk.tokens, vocab_size)


def step_tokens(chunks: Sequence[SeqChunk], requests: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's token ids and their positions (each request's rows continue where it stopped), as
    int64 host tensors built at C speed: no Python list of every token (positions of a 32k-token
    prompt from ``arange`` take ~0.04 ms, from a Python range ~1 ms)."""
    ids = array.array("q")
    for chunk in chunks:
        ids.extend(chunk.tokens)
    positions = torch.cat([torch.arange(request.num_computed, request.num_computed + len(chunk.tokens))
                           for chunk, request in zip(chunks, requests)])
    return torch.frombuffer(ids, dtype=torch.int64), positions
