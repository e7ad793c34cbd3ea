"""Piecewise CUDA graphs: a region split into pieces (passes/split_pieces.py), one
:class:`CUDAGraphPiece` wrapper per compiled piece, the package's ops and the gathers run eagerly
between them. Per distinct key of the region (the values of the size symbols its pieces' inputs
have):

- first call: every piece runs as compiled (warm-up: Triton kernels load, autotuning happens);
- second call: every piece is recorded, in order, in one forward, then replayed at once;
- later calls: every piece is replayed.

Why every piece of a key records in the same forward: the pieces share one memory pool, and a
recorded graph keeps only non-owning views of its outputs. A value stays alive until its last
reader has run, so no piece's temporaries overlap a value a later piece still reads; a replay of
the same key repeats that exact order, so it is safe too. Keys do not interleave inside one region
(one key per call), so graphs of other keys, which reuse the same pool memory, never run while
this key's values are live. The full and the reduced region have a pool each for the same reason:
their keys (T and R) interleave within one step.

Inputs a piece reads that no recorded piece of this forward produced (region inputs, outputs of
eager ops) are copied into staging buffers before each replay; staging is shared by all pieces
(slot ``i`` for a piece's ``i``-th input), sized by the largest key recorded first. Parameters
are read in place; if one moves, the region's graphs are dropped and recorded again.

A step recorded as one whole-step CUDA graph (runtime/whole_step_graphs.py) runs the pieces as
compiled: a graph cannot be recorded inside another.
"""

from __future__ import annotations

import importlib.util
import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import sympy
import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from fx_fastprefill.passes.fx_utils import placeholders, size_sources
from fx_fastprefill.passes.split_pieces import GRAPH, PieceInfo, piece_signature

from ..ops.step_context import WHOLE_STEP, current_step
from .. import fallbacks as reasons
from . import graph_lifecycle as lifecycle
from . import program_env
from .compile_graph import BoxedFn, GraphCode, compile_boxed, returns_tuple, swap_submodule

log = logging.getLogger("fx_fastprefill")

# What the pieces do in the current call: the region's action for its key (RECORD, REPLAY; the
# others run the pieces as compiled).
RECORD, REPLAY, NO_GRAPH = lifecycle.RECORD, lifecycle.REPLAY, lifecycle.NO_GRAPH


def recording_refusal(compiler: str, on_cuda: bool, recorder: Any) -> str | None:
    """Why a program's graphs cannot be recorded (a fallback reason), or None where they can: they
    record Inductor's pieces on CUDA, unless a recorder of the caller's (tests' stand-in) records
    them. The one rule: the backend applies it to each graph it compiles, the Runner once, to
    decide whether it records whole-step graphs."""
    if recorder is not None:
        return None
    if compiler != "inductor":
        return reasons.CUDAGRAPHS_NEED_INDUCTOR
    if not on_cuda:
        return reasons.CUDAGRAPHS_NOT_CUDA
    return None


class _DeviceMemory:
    """Device memory described by ``__cuda_array_interface__`` (version 3, no stream: no
    synchronization): ``torch.as_tensor`` makes a tensor over it that keeps this object, not the
    memory's owner, alive."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "strides": None, "version": 3}


def non_owning(t: Tensor) -> Tensor:
    """A tensor over ``t``'s memory that does not keep it allocated (what a graph's output becomes
    once its recording forward has ended: the graph, not the tensor, owns that memory). The bytes
    of ``t``'s storage are read as ``uint8`` (the interface has no bfloat16), then viewed as ``t``."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:  # nothing to own
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    raw = torch.as_tensor(_DeviceMemory(storage.data_ptr(), storage.nbytes()))
    if raw.device != t.device or raw.data_ptr() != storage.data_ptr():
        raise RuntimeError(f"a non-owning view of {t.device} memory came out on {raw.device} at another address")
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def non_owning_supported() -> bool:
    """``torch.as_tensor`` reads ``__cuda_array_interface__`` through numpy (a dependency)."""
    return importlib.util.find_spec("numpy") is not None


def _copy(t: Tensor) -> Tensor:
    """A copy with ``t``'s strides (its readers were compiled for them), unless ``t`` overlaps itself."""
    if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        return t.clone()
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Recorder(Protocol):
    """How a piece is recorded and how its outputs are held: CUDA graphs, or a stand-in in tests."""

    def capture(self, fn: BoxedFn, args: list, pool: Any) -> tuple[Any, list]: ...

    def new_pool(self) -> Any: ...

    def alias(self, t: Tensor) -> Tensor: ...


class CUDAGraphRecorder:
    """Records on a side stream (the default stream cannot record) into the region's pool."""

    def __init__(self) -> None:
        self.stream = None

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: BoxedFn, args: list, pool: Any) -> tuple[Any, list]:
        """Record ``fn(args)``, then replay it: recording computes nothing, and this forward needs the values."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=pool)
            try:
                outputs = fn(list(args))
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        graph.replay()
        return graph, outputs

    alias = staticmethod(non_owning)


class StagingBuffers:
    """Fixed-address buffers for a piece's copied inputs: slot ``i`` for every piece's ``i``-th
    input. A slot grows by a new buffer; graphs recorded on the old one keep it alive."""

    def __init__(self) -> None:
        self.slots: dict[int, Tensor] = {}

    def view(self, slot: int, like: Tensor) -> Tensor:
        extent = 1 + sum((s - 1) * st for s, st in zip(like.shape, like.stride())) if like.numel() else 0
        nbytes = max(extent, 1) * like.element_size()
        buffer = self.slots.get(slot)
        if buffer is None or buffer.numel() < nbytes or buffer.device != like.device:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
            self.slots[slot] = buffer
        return buffer[:nbytes].view(like.dtype).as_strided(like.shape, like.stride())

    def owns(self, t: Tensor) -> bool:
        ptr = _storage(t)
        return any(ptr == b.untyped_storage().data_ptr() for b in self.slots.values())


@dataclass
class _RecordedPiece:
    graph: Any                          # torch.cuda.CUDAGraph (or a test's stand-in)
    staged: list[tuple[int, Tensor]]    # (input position, its staging view), copied in before a replay
    outputs: list[Any]                  # non-owning views of the graph's outputs (or non-tensors)
    copy_out: list[int]                 # outputs that alias staging: copied out after a replay


@dataclass
class _RegionState:
    """One region's run-time side, kept by the running program's env (program_env.py), never
    pickled: the mode and key of the current call, the pool, the staging buffers, the storages a
    recording forward reads in place (parameters, and what its recorded pieces produced), each
    piece's recorded graphs by key, and where each key stands (graph_lifecycle.py)."""
    recorder: Recorder
    keys: lifecycle.KeyedGraphLifecycle
    record_fallback: Callable[[str], None]
    mode: lifecycle.GraphAction = NO_GRAPH
    key: tuple = ()
    pool: Any = None
    staging: StagingBuffers = field(default_factory=StagingBuffers)
    produced: set[int] = field(default_factory=set)
    graphs: list = field(default_factory=list)  # every recorded graph, kept alive (pool bookkeeping)
    recorded: dict[int, dict[tuple, _RecordedPiece]] = field(default_factory=dict)  # by piece index, then key
    static_ptrs: list[int] | None = None


# The state of the region whose pieces run now (set by PiecewiseRegion around its split's call).
_ACTIVE: ContextVar[_RegionState | None] = ContextVar("fx_fastprefill_active_region", default=None)


class CUDAGraphPiece:
    """One compiled piece: run as compiled, recorded, or replayed, as its region's call decides
    (the region's state, :data:`_ACTIVE`). Plain data: the compiled piece and how it is called."""

    def __init__(self, fn: BoxedFn, static: list[bool], single: bool, index: int):
        self.fn, self.static, self.single, self.index = fn, static, single, index

    def __call__(self, *args: Any) -> Any:
        state = _ACTIVE.get()
        mode = NO_GRAPH if state is None else state.mode
        if mode == REPLAY:
            outputs = self._replay(state.recorded[self.index][state.key], args)
        elif mode == RECORD:
            outputs = self._record(state, list(args))
        else:
            outputs = self.fn(list(args))
        return outputs[0] if self.single else tuple(outputs)

    def _record(self, state: _RegionState, args: list) -> list:
        staged = []
        for i, value in enumerate(args):
            if isinstance(value, Tensor) and not self.static[i] and _storage(value) not in state.produced:
                view = state.staging.view(i, value)
                view.copy_(value)
                staged.append((i, view))
                args[i] = view
        if state.pool is None:
            state.pool = state.recorder.new_pool()
        graph, outputs = state.recorder.capture(self.fn, args, state.pool)
        state.graphs.append(graph)
        copy_out = [j for j, o in enumerate(outputs) if isinstance(o, Tensor) and state.staging.owns(o)]
        state.recorded.setdefault(self.index, {})[state.key] = _RecordedPiece(
            graph, staged, [state.recorder.alias(o) if isinstance(o, Tensor) else o for o in outputs], copy_out)
        outputs = [_copy(o) if j in copy_out else o for j, o in enumerate(outputs)]
        # Owning until this forward ends; a copied-out value gets a new address each replay: its readers stage it.
        state.produced.update(_storage(o) for j, o in enumerate(outputs) if isinstance(o, Tensor) and j not in copy_out)
        return outputs

    @staticmethod
    def _replay(piece: _RecordedPiece, args: tuple) -> list:
        for i, view in piece.staged:
            value = args[i]
            if value.data_ptr() != view.data_ptr():
                view.copy_(value)
        piece.graph.replay()
        if not piece.copy_out:
            return piece.outputs
        return [_copy(o) if j in piece.copy_out else o for j, o in enumerate(piece.outputs)]


class PiecewiseRegion:
    """A region run piece by piece; decides per call whether its pieces warm up, record or replay.

    ``static`` are the region inputs read in place (parameters, buffers). Each call that runs
    without graphs is counted and logged with its reason by the running program's env, which also
    keeps the region's graphs (program_env.py): the region itself is plain data. ``copy_outputs``:
    return copies, not views of graph memory that the next call rewrites (for a region whose
    outputs leave the model).
    """

    def __init__(self, region: GraphModule, compiler: str, static_input_idxs: list[int],
                 pieces: tuple[GraphModule, list[PieceInfo]], compiled_pieces: dict | None = None):
        """``pieces``: the region split by the pipeline's ``pieces`` pass (a cut's region, or a
        graph compiled unchanged). ``compiled_pieces``: pieces compiled so far in this shape
        environment, by their signature (shared by a program's regions); a piece equal to one of
        them is not compiled again."""
        inputs = placeholders(region)
        self.split, infos = pieces
        compiled = {} if compiled_pieces is None else compiled_pieces
        self.key_sizes = self._key_sizes(inputs, infos)
        self.pieces: list[CUDAGraphPiece] = []
        static_inputs = {inputs[i].name for i in static_input_idxs}
        calls = {n.target: n for n in self.split.graph.nodes if n.op == "call_module"}
        for info in infos:
            if info.kind != GRAPH:
                continue  # eager ops and views run as they are (their submodules' own code)
            module = getattr(self.split, info.name)
            static = [
                isinstance(a, Node) and (a.op == "get_attr" or a.name in static_inputs) for a in calls[info.name].args
            ]
            static_idxs = [i for i, s in enumerate(static) if s]
            key = piece_signature(module, static_idxs)
            if key not in compiled:
                compiled[key] = compile_boxed(module, compiler, static_idxs)
            piece = CUDAGraphPiece(compiled[key], static, not returns_tuple(module), len(self.pieces))
            self.pieces.append(piece)
            swap_submodule(self.split, info.name, piece)
        for info in infos:
            if info.kind != GRAPH:
                swap_submodule(self.split, info.name, GraphCode(getattr(self.split, info.name)))
        self.split = GraphCode(self.split)
        self.static_positions = sorted(static_input_idxs)
        self.copy_outputs = False

    @staticmethod
    def _new_state(env: program_env.ProgramEnv) -> _RegionState:
        """Fresh graph state under ``env``: a new pool, staging and lifecycle."""
        keys = lifecycle.KeyedGraphLifecycle(env.record_fallback, reasons.CUDAGRAPH_WARMUP,
                                             reasons.CUDAGRAPH_RECORD_FAILED)
        return _RegionState(program_env.recorder() or CUDAGraphRecorder(), keys, env.record_fallback)

    def _key_sizes(self, inputs: list[Node], infos) -> list[tuple[int, int | None]]:
        """Where to read the sizes that fix every recorded piece's input shapes: one (input, dim)
        per size symbol those shapes use. The K/V read only by eager attention add no key."""
        symbols: set[sympy.Symbol] = set()
        for info in infos:
            if info.kind != GRAPH:
                continue
            for node in placeholders(getattr(self.split, info.name)):
                val = node.meta.get("val")
                sizes = val.shape if isinstance(val, Tensor) else [val] if isinstance(val, torch.SymInt) else []
                for size in sizes:
                    if isinstance(size, torch.SymInt):
                        symbols |= size.node.expr.free_symbols
        sources = size_sources(inputs)
        missing = symbols - set(sources)
        if missing:
            raise ValueError(f"sizes {sorted(map(str, missing))} of the region's pieces are not sizes of its inputs")
        return [sources[s] for s in sorted(symbols, key=str)]

    def _key(self, args: tuple) -> tuple:
        return tuple(int(args[i]) if dim is None else args[i].shape[dim] for i, dim in self.key_sizes)

    def __call__(self, *args: Any) -> Any:
        state = program_env.current().state_of(self, self._new_state)
        token = _ACTIVE.set(state)
        try:
            return self._output(self._run(state, args))
        finally:
            _ACTIVE.reset(token)

    def _run(self, state: _RegionState, args: tuple) -> Any:
        step = current_step()
        if step is not None and step.graph_mode == WHOLE_STEP:
            # Inside a whole-step graph (recording it, or warming it up): no graphs of our own.
            state.mode = NO_GRAPH
            return self.split(*args)
        key, action = self._state(state, args)
        state.key, state.mode = key, action
        if action == RECORD:
            # Read in place, like values the pieces produce: parameters, and views of them that a
            # views-only piece makes (a weight's transpose).
            state.produced.update(_storage(args[i]) for i in self.static_positions if isinstance(args[i], Tensor))
            try:
                out = self.split(*args)
                state.keys.recorded(key)
                return out
            except Exception as e:  # noqa: BLE001 - counted and logged; this key runs without graphs
                log.warning("recording the CUDA graphs of a region failed for sizes %s: %s", key, e,
                            exc_info=not state.keys.failures)
                state.keys.failed(key)
                state.mode = NO_GRAPH
            finally:
                state.produced.clear()
        return self.split(*args)

    def _output(self, out: Any) -> Any:
        if not self.copy_outputs:
            return out
        if isinstance(out, tuple):
            return tuple(o.clone() if isinstance(o, Tensor) else o for o in out)
        return out.clone() if isinstance(out, Tensor) else out

    def _state(self, state: _RegionState, args: tuple) -> tuple[tuple, lifecycle.GraphAction]:
        """This call's key and what to do for it (graph_lifecycle.py: warm up, record, replay, or run
        without graphs)."""
        ptrs = [args[i].data_ptr() if isinstance(args[i], Tensor) else None for i in self.static_positions]
        if state.static_ptrs is not None and ptrs != state.static_ptrs:
            state.record_fallback(reasons.CUDAGRAPH_STATIC_INPUT_MOVED)
            state.recorded.clear()  # their graphs stay alive in state.graphs
            state.keys.clear()
        state.static_ptrs = ptrs
        key = self._key(args)
        return key, state.keys.action(key)
