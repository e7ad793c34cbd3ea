"""What a compiled program reads, at run time, from whoever runs it: where its fallbacks are
counted, what records its graphs, and the graphs it has recorded.

A compiled program (compilation/regions.py, cudagraphs.py) is plain data: it pickles whole and
runs as loaded, with nothing bound into it afterwards. Its run-time state lives here instead:

- :class:`ProgramEnv`: the fallback sink and each region's graph state, owned by the
  ``ProgramCode`` that holds the program (one per compiled or loaded program), which sets it
  around every call (:func:`running`), as the step contract reaches the ops (ops/step_context.py);
- the recorder (:func:`recording_with`): set by whoever runs the model, the Runner or a test's
  stand-in for CUDA graphs on the CPU. It is not a compile option and not in any cache key: it
  says how graphs are recorded, not what is compiled.

A program called outside any env (a test calling it directly) counts into :data:`UNOWNED`.
"""

from __future__ import annotations

import contextlib
import weakref
from contextvars import ContextVar
from typing import Any, Callable, Iterator

from ..fallbacks import FallbackCounter
from ..vocabulary import Vocabulary


class GraphKeys(Vocabulary):
    """How a program keys the graphs it records, which a caller recording every size must know
    (the Runner's ``capture``): the program declares it, the caller asks (:func:`declared_keys`)."""
    APART = "apart"        # a cut program: the full region by the step's rows T, the reduced by R
    TOGETHER = "together"  # compiled unchanged: one region keyed by (T, R)
    NONE = "none"          # no graphs of its own


class ProgramEnv:
    """One program's run-time side: ``record_fallback`` counts (and logs) each step that leaves a
    fast path; :meth:`state_of` keeps each region's graph state for as long as the region lives."""

    def __init__(self, record_fallback: Callable[[str], None]):
        self.record_fallback = record_fallback
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def state_of(self, part: Any, make: Callable[["ProgramEnv"], Any]) -> Any:
        """``part``'s state, made by ``make(self)`` on its first call under this env."""
        state = self._states.get(part)
        if state is None:
            state = self._states[part] = make(self)
        return state


UNOWNED_FALLBACKS = FallbackCounter()
UNOWNED = ProgramEnv(UNOWNED_FALLBACKS.record)
_ENV: ContextVar[ProgramEnv | None] = ContextVar("fx_fastprefill_program_env", default=None)
_RECORDER: ContextVar[Any] = ContextVar("fx_fastprefill_graph_recorder", default=None)
_DECLARED: ContextVar[list | None] = ContextVar("fx_fastprefill_declared_keys", default=None)


def current() -> ProgramEnv:
    """The env of the program running now (:data:`UNOWNED` outside any)."""
    return _ENV.get() or UNOWNED


class running:
    """Within: the program's parts read ``env``; the program declares ``graph_keys`` to a caller
    that asks (:func:`declared_keys`). A class, not a generator: it is entered on every call of
    every compiled program."""

    __slots__ = ("env", "graph_keys", "token")

    def __init__(self, env: ProgramEnv, graph_keys: GraphKeys = GraphKeys.NONE):
        self.env, self.graph_keys = env, graph_keys

    def __enter__(self) -> None:
        declared = _DECLARED.get()
        if declared is not None:
            declared.append(self.graph_keys)
        self.token = _ENV.set(self.env)

    def __exit__(self, *exc: object) -> None:
        _ENV.reset(self.token)


@contextlib.contextmanager
def declared_keys() -> Iterator[list[GraphKeys]]:
    """Within: each program that runs appends how it keys its graphs to the list yielded."""
    declared: list[GraphKeys] = []
    token = _DECLARED.set(declared)
    try:
        yield declared
    finally:
        _DECLARED.reset(token)


def recorder() -> Any:
    """The recorder set by :func:`recording_with`, or None (CUDA graphs, on CUDA inputs)."""
    return _RECORDER.get()


@contextlib.contextmanager
def recording_with(graph_recorder: Any) -> Iterator[None]:
    """Within: graphs are recorded by ``graph_recorder`` (compilation/cudagraphs.py: ``Recorder``),
    and a graph on non-CUDA inputs is compiled to record with it (tests' stand-in on the CPU)."""
    token = _RECORDER.set(graph_recorder)
    try:
        yield
    finally:
        _RECORDER.reset(token)
