"""One lifecycle for graphs recorded per key, shared by the piecewise pieces of a region (key: the
sizes of its inputs, compilation/cudagraphs.py) and the whole-step graphs (key: the padded row
count, runtime/whole_step_graphs.py).

A key's first call warms up (runs without a graph: kernels load, Dynamo and Inductor compile what
they need, and recording must not compile); its second call records; later calls replay. A key
whose recording failed runs without graphs from then on. Every call that runs without a graph is
counted and logged with its reason (``record_fallback``).
"""

from __future__ import annotations

from typing import Callable, Hashable

from ..vocabulary import Vocabulary


class GraphAction(Vocabulary):
    """What a call does with its key's graph: the one vocabulary of the pieces' and the whole-step
    graphs' record and replay. WARM_UP and NO_GRAPH run without a graph."""
    WARM_UP = "warm_up"
    RECORD = "record"
    REPLAY = "replay"
    NO_GRAPH = "no_graph"


WARM_UP, RECORD, REPLAY, NO_GRAPH = GraphAction.WARM_UP, GraphAction.RECORD, GraphAction.REPLAY, GraphAction.NO_GRAPH


class KeyState(Vocabulary):
    """Where a key stands."""
    WARMED = "warmed"
    RECORDED = "recorded"
    FAILED = "failed"


_WARMED, _RECORDED, _FAILED = KeyState.WARMED, KeyState.RECORDED, KeyState.FAILED


class KeyedGraphLifecycle:
    """Where each key stands, and what its next call does (:meth:`action`)."""

    def __init__(self, record_fallback: Callable[[str], None], warmup_reason: str, failed_reason: str):
        self.record_fallback = record_fallback
        self.warmup_reason, self.failed_reason = warmup_reason, failed_reason
        self.states: dict[Hashable, KeyState] = {}
        self.failures = 0

    def action(self, key: Hashable) -> GraphAction:
        """WARM_UP (the key's first call), RECORD (its second), REPLAY, or NO_GRAPH (it failed)."""
        state = self.states.get(key)
        if state is None:
            self.states[key] = _WARMED
            self.record_fallback(self.warmup_reason)
            return WARM_UP
        if state == _WARMED:
            return RECORD
        if state == _RECORDED:
            return REPLAY
        self.record_fallback(self.failed_reason)
        return NO_GRAPH

    def gave_up(self, key: Hashable) -> bool:
        """Whether ``key``'s recording failed: its calls run without graphs, each one counted.
        Asked before a call is planned (runtime/step_plan.py), so that it is planned the other way."""
        if self.states.get(key) != _FAILED:
            return False
        self.record_fallback(self.failed_reason)
        return True

    def recorded(self, key: Hashable) -> None:
        self.states[key] = _RECORDED

    def failed(self, key: Hashable) -> None:
        """The recording of ``key`` failed: counted now, and its calls run without graphs."""
        self.states[key] = _FAILED
        self.failures += 1
        self.record_fallback(self.failed_reason)

    def settled(self, key: Hashable) -> bool:
        """Recorded, or failed for good: nothing left to do for ``key``."""
        return self.states.get(key) in (_RECORDED, _FAILED)

    def clear(self) -> None:
        """Forget every key (what was recorded no longer holds: a parameter moved)."""
        self.states.clear()
