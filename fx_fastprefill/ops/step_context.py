"""Per-step batch metadata, visible to the attention op and to the compiled graph's runtime.

The attention op is opaque to the compiler, so whatever changes every step (which rows belong to
which request, where each request's KV cache lives, how many logits rows are real) travels beside
the graph, in this context, instead of through the graph's inputs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, TypeVar

import torch

from .. import fallbacks as reasons
from ..vocabulary import Vocabulary
from .kv_cache import KVCache

T = TypeVar("T")

class GraphMode(Vocabulary):
    """A step's graph mode, decided once by the Runner and obeyed by the regions, the pieces and
    the attention op (never re-derived from the step's other fields)."""
    WHOLE_STEP = "whole_step"  # recorded into, replayed as or warming up one whole-step CUDA graph
    PIECEWISE = "piecewise"    # the compiled model's regions (with their piecewise CUDA graphs, if any)
    EAGER = "eager"            # the model run as it is (no backend)


class ReducedMode(Vocabulary):
    """What a cut graph's reduced region does in a step, decided once per step
    (plan_reduced_region) and obeyed by its gate (compilation/regions.py: StepGate)."""
    SKIP = "skip"                # no logits rows: not run, its outputs empty
    ALL_ROWS = "all_rows"        # run on every row, the logits rows selected after it
    LOGITS_ROWS = "logits_rows"  # run on the rows it is given (the fast path)


WHOLE_STEP, PIECEWISE, EAGER = GraphMode.WHOLE_STEP, GraphMode.PIECEWISE, GraphMode.EAGER
GRAPH_MODES = tuple(GraphMode)
REDUCED_SKIP, REDUCED_ALL_ROWS, REDUCED_LOGITS_ROWS = ReducedMode.SKIP, ReducedMode.ALL_ROWS, ReducedMode.LOGITS_ROWS


@dataclass(frozen=True)
class ReducedPlan:
    """The reduced region's mode in a step, and the fallback counted for it (None: not one)."""
    mode: ReducedMode
    fallback: str | None = None


@dataclass
class DecodeRows:
    """Per-row metadata of a step recorded as one whole-step CUDA graph, in device tensors at fixed
    addresses (the graph reads them; the Runner rewrites them before each replay). Row ``r`` is
    one query at ``position[r]`` of a request whose cache starts at slot ``key_start[r]``: it
    writes its K/V to slot ``slots[r]`` and reads keys ``[key_start[r], key_start[r] + key_len[r])``.
    Nothing in such a step may read the host lists of :class:`StepMetadata`: a replay runs no Python."""

    slots: torch.Tensor      # int64 [P]
    key_start: torch.Tensor  # int32 [P]
    key_len: torch.Tensor    # int32 [P]
    position: torch.Tensor   # int32 [P]


@dataclass
class StepMetadata:
    """One step of a packed variable-length batch.

    Rows of the batch are grouped by request, in order: request ``i`` owns rows
    ``query_start[i] : query_start[i + 1]``, which are its tokens at positions
    ``context_lens[i] ...``; its KV cache occupies slots ``slot_base[i] + position``.
    """

    query_start: list[int]
    context_lens: list[int]
    slot_base: list[int]
    kv_cache: KVCache
    # Real number of logits rows of the step (the model may see more: padding).
    num_logits: int
    # True when some request has a prompt row that needs no logits (the reduced region can help).
    has_prefill: bool
    step_id: int = 0
    # The real logits rows (before padding), when the caller knows them: lets a varlen kernel run
    # the query-subset form without reading the row indices back from the device.
    logits_rows: list[int] | None = None
    # How the step runs (GRAPH_MODES). A whole-step graph's key is its padded row count, the step's
    # size; piecewise regions key their graphs by their inputs' sizes.
    graph_mode: GraphMode = PIECEWISE
    # A whole-step graph's rows' metadata on the device. The host lists above then describe only the
    # recording call.
    decode_rows: DecodeRows | None = None
    # The reduced region's plan, set by whoever builds the step and knows its padded sizes (the
    # Runner); None: the gate plans from the sizes it is called with.
    reduced: ReducedPlan | None = None
    # Values built once per step and shared by its attention calls (see cached()).
    _tensors: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {[str(m) for m in GRAPH_MODES]}, got {self.graph_mode!r}")
        if (self.graph_mode == WHOLE_STEP) != (self.decode_rows is not None):
            raise ValueError("a whole-step graph step carries its rows' device metadata (decode_rows), no other does")

    @property
    def whole_step_graph(self) -> bool:
        """The step is recorded into, or warms up, a whole-step CUDA graph: every row one query
        that needs its logits, the attention inside the graph, fast prefill off (nothing to cut)."""
        return self.graph_mode == WHOLE_STEP

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    def tensor(self, name: str, device: torch.device) -> torch.Tensor:
        """The named per-step list as an int64 tensor on ``device``, built once per step."""
        return self.cached(f"{name}@{device}",
                           lambda: to_device(torch.tensor(getattr(self, name), dtype=torch.int64), device))

    def cached(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, once per step: what every attention call of the step shares (a kernel's
        packing of the batch, the rows' cache slots)."""
        if key not in self._tensors:
            self._tensors[key] = build()
        return self._tensors[key]


def plan_reduced_region(step: StepMetadata | None, padded_rows: int, padded_tokens: int) -> ReducedPlan:
    """The reduced region's plan for a step of ``padded_tokens`` rows, ``padded_rows`` of them
    passed as logits rows (what the compiled graph is called with): the step's own plan where its
    builder set one (the Runner's dispatcher always does), else :func:`reduced_region_plan` of
    what the step says; outside any step, every row (or none)."""
    if step is not None and step.reduced is not None:
        return step.reduced
    if step is None:
        if padded_rows == 0:
            return ReducedPlan(REDUCED_SKIP, reasons.NO_LOGITS_ROWS)
        return ReducedPlan(REDUCED_ALL_ROWS, reasons.NO_STEP_METADATA)
    return reduced_region_plan(step.graph_mode, step.num_logits, step.has_prefill, padded_rows, padded_tokens)


def reduced_region_plan(graph_mode: GraphMode, num_logits: int, has_prefill: bool, padded_rows: int,
                        padded_tokens: int) -> ReducedPlan:
    """The rule: skip a step of no logits rows, run every row of a pure decode step or of one whose
    padded logits rows are no fewer than its rows, else only the logits rows (the fast path)."""
    if graph_mode == WHOLE_STEP:
        # Every row of a whole-step graph is a logits row, passed in order: the region's gathers
        # are the full-rows path already. A decode step, not a fallback.
        return ReducedPlan(REDUCED_LOGITS_ROWS)
    if padded_rows == 0 or num_logits == 0:
        return ReducedPlan(REDUCED_SKIP, reasons.NO_LOGITS_ROWS)
    if not has_prefill:
        return ReducedPlan(REDUCED_ALL_ROWS, reasons.PURE_DECODE)
    if padded_rows >= padded_tokens:
        return ReducedPlan(REDUCED_ALL_ROWS, reasons.NOT_SMALLER)
    return ReducedPlan(REDUCED_LOGITS_ROWS)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host data onto ``device`` without stalling it: a copy from pageable memory waits for every
    kernel already queued on the stream, one from pinned memory does not, so the host keeps
    running ahead of the GPU through a step's many small metadata copies."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    # Straight from the pinned caching allocator: ``t.pin_memory()`` first asks the driver whether
    # ``t`` is pinned, seen taking 2.7 ms at the start of a step on the H200.
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)


_current: StepMetadata | None = None


def current_step() -> StepMetadata | None:
    """The step being executed, or None outside :func:`step_context`."""
    return _current


@contextlib.contextmanager
def step_context(meta: StepMetadata) -> Iterator[StepMetadata]:
    """Make ``meta`` the current step for the attention op and the fast-prefill runtime."""
    global _current
    previous, _current = _current, meta
    try:
        yield meta
    finally:
        _current = previous
