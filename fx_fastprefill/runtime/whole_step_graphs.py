"""Whole-step CUDA graphs for steps whose every row needs logits: decode, and a few draft rows.

Piecewise graphs (compilation/cudagraphs.py) leave the attention ops and the gathers eager between
the pieces, which costs host launches per layer; a decode step has no prefill rows to cut, so the
whole forward can be one graph instead. One graph per padded row count ``P`` (a size of
``sizes``):

- the graph's inputs are one int64 device buffer (token ids, positions, the first cache slot of
  each row's request) refilled by one host-to-device copy before a replay, and ``arange(P)`` as
  the logits indices;
- the rows' cache slots and key ranges (:class:`DecodeRows`) are computed inside the graph from
  that buffer, and the attention reads them there (ops/kernels/decode.py): no host value that
  changes between steps is baked into a launch;
- rows past the step's own are padding rows, each a one-token request in a slot of its own
  (after the requests' regions), at position 0;
- a size is warmed up on its first step (compiled as needed, run without a graph), recorded on
  its second; every size records into one memory pool (one graph runs at a time), and the
  logits are copied out after each replay.

The model runs with ``StepMetadata.decode_rows`` set, which turns fast prefill off for the step
(every row is a logits row) and runs the piecewise regions without graphs of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import fallbacks as reasons
from ..compilation import graph_lifecycle as lifecycle
from ..ops.kv_cache import KVCache
from ..ops.step_context import REDUCED_LOGITS_ROWS, WHOLE_STEP, DecodeRows, ReducedPlan, StepMetadata

log = logging.getLogger("fx_fastprefill")

# Rows of one request a whole-step graph takes: one decode token, or a few draft tokens to verify.
# More rows per request re-read its keys once per row: chunks that long go the piecewise way.
MAX_ROWS_PER_REQUEST = 4


class WholeStepGraphs:
    """The graphs of one Runner, for row counts ``sizes``; ``forward(ids, positions, indices)``
    runs the compiled model under the step context it is given; ``record_fallback`` counts each
    step planned here that runs without a graph, with its reason."""

    def __init__(self, forward: Callable[[StepMetadata, Tensor, Tensor, Tensor], Tensor], kv_cache: KVCache,
                 sizes: Sequence[int], recorder: Any, record_fallback: Callable[[str], None],
                 next_step_id: Callable[[], int]):
        self.forward, self.kv_cache, self.sizes = forward, kv_cache, sorted(sizes)
        self.recorder, self.record_fallback, self.next_step_id = recorder, record_fallback, next_step_id
        device, self.max_rows = kv_cache.device, self.sizes[-1]
        self.rows = torch.zeros(3, self.max_rows, dtype=torch.int64, device=device)  # ids, positions, first slots
        self.indices = torch.arange(self.max_rows, device=device)
        self.lifecycle = lifecycle.KeyedGraphLifecycle(record_fallback, reasons.WHOLE_STEP_WARMUP,
                                                       reasons.WHOLE_STEP_RECORD_FAILED)
        self.graphs: dict[int, tuple[Any, Tensor]] = {}
        self.pool: Any = None
        self.replays = 0

    def size_for(self, num_rows: int) -> int | None:
        """The recorded size a step of ``num_rows`` rows pads to; None when it is larger than every size."""
        return next((size for size in self.sizes if size >= num_rows), None)

    def run(self, ids: Sequence[int], positions: Sequence[int], first_slots: Sequence[int], size: int) -> Tensor:
        """The logits of a step of these rows (a copy, ``[len(ids), vocab]``), through the graph of
        ``size`` rows (the step's plan: runtime/step_plan.py). The first step of a size warms it
        up, the second records it; a size whose recording failed runs without a graph, counted."""
        num_rows = len(ids)
        if not num_rows <= size <= self.max_rows or size not in self.sizes:
            raise ValueError(f"a step of {num_rows} rows planned for a whole-step graph of {size} rows "
                             f"(sizes: {self.sizes})")
        action = self.lifecycle.action(size)
        self._fill(size, ids, positions, first_slots)
        if action == lifecycle.REPLAY:
            graph, logits = self.graphs[size]
            graph.replay()
            self.replays += 1
            return logits[:num_rows].clone()
        if action == lifecycle.RECORD:
            logits = self._record(size)
            if logits is not None:
                return logits[:num_rows].clone()
        return self._call(size)[:num_rows]  # warming up, or no graph for this size

    def _fill(self, size: int, ids: Sequence[int], positions: Sequence[int], first_slots: Sequence[int]) -> None:
        """Write the rows and the padding rows behind them into the input buffer, in one copy."""
        pad = range(len(ids), size)
        host = torch.tensor([[*ids, *(0 for _ in pad)], [*positions, *(0 for _ in pad)],
                             [*first_slots, *(self.kv_cache.padding_base + j for j in pad)]], dtype=torch.int64)
        if self.rows.is_cuda:  # from pinned memory: the host does not wait for the queued kernels
            host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
        self.rows[:, :size].copy_(host, non_blocking=True)

    def _call(self, size: int) -> Tensor:
        """One forward of ``size`` rows from the input buffer (what a graph records)."""
        ids, positions, first_slots = self.rows[0, :size], self.rows[1, :size], self.rows[2, :size]
        rows = DecodeRows(slots=first_slots + positions, key_start=first_slots.int(), key_len=(positions + 1).int(),
                          position=positions.int())
        meta = StepMetadata(query_start=list(range(size + 1)), context_lens=[0] * size, slot_base=[0] * size,
                            kv_cache=self.kv_cache, num_logits=size, has_prefill=False, step_id=self.next_step_id(),
                            graph_mode=WHOLE_STEP, decode_rows=rows, reduced=ReducedPlan(REDUCED_LOGITS_ROWS))
        return self.forward(meta, ids, positions, self.indices[:size])

    def _record(self, size: int) -> Tensor | None:
        """The graph of ``size`` rows recorded (its logits, in graph memory); None, counted and
        logged, where recording failed: the size runs without a graph from then on."""
        if self.pool is None:
            self.pool = self.recorder.new_pool()
        try:
            # A recompile inside a recording would compile on a capturing stream: fail instead.
            with torch.compiler.set_stance("fail_on_recompile"):
                graph, outputs = self.recorder.capture(lambda _: [self._call(size)], [], self.pool)
        except Exception:  # noqa: BLE001 - counted and logged; this size runs without a graph from now on
            log.warning("recording the whole-step CUDA graph of %d rows failed", size, exc_info=True)
            self.lifecycle.failed(size)
            return None
        self.graphs[size] = (graph, outputs[0])
        self.lifecycle.recorded(size)
        return outputs[0]

    def warm_up_and_record(self) -> None:
        """Record every size now, largest first, with padding rows only."""
        for size in reversed(self.sizes):
            while not self.lifecycle.settled(size):
                self.run([], [], [], size)
