"""The step dispatcher: the one place a step's plan is decided, before the model runs.

A step's plan is its graph mode (one whole-step graph, the compiled model's regions, or the model
as it is), the sizes the model is called with (the rows padded up to a recorded size, the logits
rows padded up to a logits size), and what the reduced region of a cut graph does (skip, every
row, the logits rows). Everything that runs in the step obeys the plan: the whole-step graphs
(runtime/whole_step_graphs.py), the regions' gate (compilation/regions.py: ``StepGate``), the
pieces and the attention op read it from the step context. None of them derives its own.

The sizes come from what the Runner was configured with and what the compiled program keyed its
graphs by; whether graphs can be recorded at all is decided once, when the Runner is made
(compilation/cudagraphs.py: ``recording_refusal``, the rule the backend applies to each graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .. import fallbacks as reasons
from ..ops.step_context import EAGER, PIECEWISE, WHOLE_STEP, GraphMode, ReducedPlan, reduced_region_plan
from .batch import pad_to_bucket
from .whole_step_graphs import MAX_ROWS_PER_REQUEST, WholeStepGraphs


@dataclass(frozen=True)
class StepPlan:
    """How one step runs. ``padded_tokens``: the rows the model is called with (a whole-step
    graph: its size); ``padded_logits``: the logits rows it is called with (a whole-step graph:
    every row)."""
    graph_mode: GraphMode
    num_tokens: int
    num_logits: int
    padded_tokens: int
    padded_logits: int
    reduced: ReducedPlan


class StepDispatcher:
    """Plans each step of one Runner (:meth:`plan`); ``record_fallback`` counts a step that could
    have been one whole-step graph and is not."""

    def __init__(self, *, compiled: bool, token_pad_sizes: Sequence[int], logits_pad_sizes: Sequence[int],
                 whole_step: WholeStepGraphs | None, record_fallback: Callable[[str], None]):
        self.compiled = compiled
        self.token_pad_sizes, self.logits_pad_sizes = list(token_pad_sizes), list(logits_pad_sizes)
        self.whole_step = whole_step
        self.record_fallback = record_fallback

    def plan(self, chunk_lengths: Sequence[int], num_logits: int, has_padding_request: bool = False) -> StepPlan:
        """The plan of a step of chunks of these lengths with ``num_logits`` logits rows;
        ``has_padding_request``: a chunk is the Runner's own padding (a capture), which a whole-step
        graph does not take (its padding rows are its own)."""
        num_tokens = sum(chunk_lengths)
        if (self.whole_step is not None and num_logits == num_tokens and not has_padding_request
                and all(n <= MAX_ROWS_PER_REQUEST for n in chunk_lengths)):
            size = self._whole_step_size(num_tokens)
            if size is not None:
                return StepPlan(WHOLE_STEP, num_tokens, num_logits, size, size,
                                reduced_region_plan(WHOLE_STEP, size, False, size, size))
        has_prefill = num_logits < num_tokens
        padded_logits = pad_to_bucket(num_logits, self.logits_pad_sizes)  # 0 only without buckets
        if not self.compiled:  # the model as it is: no region obeys the plan, kept for the record
            return StepPlan(EAGER, num_tokens, num_logits, num_tokens, padded_logits,
                            reduced_region_plan(EAGER, num_logits, has_prefill, padded_logits, num_tokens))
        padded_tokens = max(2, pad_to_bucket(num_tokens, self.token_pad_sizes))
        return StepPlan(PIECEWISE, num_tokens, num_logits, padded_tokens, padded_logits,
                        reduced_region_plan(PIECEWISE, num_logits, has_prefill, padded_logits, padded_tokens))

    def _whole_step_size(self, num_rows: int) -> int | None:
        """The whole-step graph size for ``num_rows`` rows; None (counted) when none takes them."""
        size = self.whole_step.size_for(num_rows)
        if size is None:
            self.record_fallback(reasons.WHOLE_STEP_TOO_LARGE)
            return None
        if self.whole_step.lifecycle.gave_up(size):  # its recording failed: counted there
            return None
        return size

