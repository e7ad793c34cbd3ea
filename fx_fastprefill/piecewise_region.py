"""A region run piece by piece, each piece replayed from a CUDA graph recorded for its sizes.

The region's steps (passes/split_at_attention.py) alternate compiled pieces and the package's ops
(attention, cache writes), which run eagerly: they read host-side step metadata. Per distinct
input-size key of the region:

- first call: every piece runs as compiled (warm-up: Triton kernels load, autotuning happens);
- second call: every piece is recorded, in order, in one forward, then replayed at once;
- later calls: every piece is replayed.

Why every piece of a key records in the same forward: the pieces share one memory pool, and a
recorded graph keeps only non-owning views of its outputs. While a forward records, the region's
values stay alive until the forward ends, so no piece's temporaries overlap a value a later
piece still reads; a replay of the same key repeats that exact order, so it is safe too. Keys do
not interleave inside one region (one key per call), so graphs of other keys, which reuse the
same pool memory, never run while this key's values are live. The full and the reduced region
have a pool each for the same reason: their keys (T and R) interleave within one step.

Inputs a piece reads that are not its own region's recorded values (region inputs, outputs of
eager ops) are copied into staging buffers before each replay; staging is shared by all pieces
(slot ``i`` for a piece's ``i``-th input), sized by the largest key recorded first. Parameters
are read in place; if one moves, the region's graphs are dropped and recorded again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from . import fallbacks as reasons

log = logging.getLogger("fx_fastprefill")

RegionFn = Callable[[list], list]
_WARMED, _FAILED = "warmed", "failed"


def non_owning(t: Tensor) -> Tensor:
    """A tensor over ``t``'s memory that does not keep it allocated (what a graph's output becomes
    once its recording forward has ended: the graph, not the tensor, owns that memory)."""
    storage = t.untyped_storage()
    meta = {"nbytes": storage.nbytes(), "data_ptr": storage.data_ptr(), "size": t.shape, "stride": t.stride(),
            "dtype": t.dtype, "device": t.device, "storage_offset": t.storage_offset()}
    alias = torch._C._construct_storage_from_data_pointer(meta["data_ptr"], t.device, meta["nbytes"])
    return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(meta, alias)


def _copy(t: Tensor) -> Tensor:
    """A copy with ``t``'s strides (its readers were compiled for them), unless ``t`` overlaps itself."""
    if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        return t.clone()
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def non_owning_supported() -> bool:
    """The installed torch can make non-owning CUDA views (a CPU-only build lacks the CUDA half,
    and never records graphs: its inputs are not on a CUDA device)."""
    has_cuda_half = hasattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata") or not torch.backends.cuda.is_built()
    return hasattr(torch._C, "_construct_storage_from_data_pointer") and has_cuda_half


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
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == b.untyped_storage().data_ptr() for b in self.slots.values())


@dataclass
class _RecordedPiece:
    graph: Any                          # torch.cuda.CUDAGraph
    staged: list[tuple[Node, Tensor]]   # (value, its staging view), copied in before a replay
    outputs: list[Any]                  # non-owning views of the graph's outputs (or non-tensors)
    copy_out: list[int]                 # outputs that alias staging: copied out after a replay


@dataclass
class _RecordedKey:
    pieces: list[_RecordedPiece | None] = field(default_factory=list)  # None: a views-only piece, run directly
    graphs: list = field(default_factory=list)


class PiecewiseRegion:
    """Runs a region's steps on CUDA, recording and replaying its pieces.

    ``static`` are the region inputs read in place (parameters, buffers); ``record_fallback`` counts
    and logs each call that runs without graphs, with its reason. ``copy_outputs``: return copies,
    not views of graph memory that the next call rewrites (for a region whose outputs leave the model).
    """

    _boxed_call = True

    def __init__(self, gm: GraphModule, steps: list, compiled: list[RegionFn | None], static: set[Node],
                 record_fallback: Callable[[str], None]):
        self.steps = [(step, fn) for step, fn in zip(steps, compiled)]
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.constants = {n: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        self.output_args = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self.static = set(static) | set(self.constants)
        self.static_positions = [i for i, n in enumerate(self.placeholders) if n in self.static]
        # The key: sizes of the non-static inputs some piece reads (the full-row K/V that only the
        # eager attention of the reduced region reads do not make a new key).
        read_by_pieces = {n for step, fn in self.steps if fn is not None for n in step.inputs}
        self.key_positions = [i for i, n in enumerate(self.placeholders) if n not in self.static and n in read_by_pieces]
        self.record_fallback = record_fallback
        self.copy_outputs = False
        self.keys: dict[tuple, Any] = {}
        self.static_ptrs: list[int] | None = None
        self.pool = None
        self.stream = None
        self.staging = StagingBuffers()
        self.failed = 0
        # Graphs of failed or dropped keys: kept, since a pool whose every graph is gone while
        # its blocks are still in use cannot be recorded into again.
        self._kept: list = []

    # ----------------------------------------------------------------------------------------------

    def _key(self, args: list) -> tuple:
        """The sizes of the non-static inputs the pieces read (parameters never change size)."""
        values = (args[i] for i in self.key_positions)
        return tuple((tuple(a.shape), a.dtype) if isinstance(a, Tensor) else a if isinstance(a, (int, float, bool))
                     else type(a) for a in values)

    def __call__(self, args: list) -> list:
        env: dict[Node, Any] = dict(zip(self.placeholders, args))
        env.update(self.constants)
        key, state = self._state(args)
        args.clear()
        if isinstance(state, _RecordedKey):
            self._replay(state, env)
        elif state is _WARMED:
            try:
                self.keys[key] = self._record(env)
            except Exception as e:  # noqa: BLE001 - counted and logged; this size runs without graphs
                log.warning("recording the CUDA graphs of a region failed for sizes %s: %s", key, e,
                            exc_info=not self.failed)
                self.keys[key] = _FAILED
                self.failed += 1
                self.record_fallback(reasons.CUDAGRAPH_RECORD_FAILED)
                env = {n: env[n] for n in list(self.placeholders) + list(self.constants)}
                self._run_plain(env)
        else:
            self._run_plain(env)
        outputs = [env[a] if isinstance(a, Node) else a for a in self.output_args]
        if self.copy_outputs:
            outputs = [o.clone() if isinstance(o, Tensor) else o for o in outputs]
        return outputs

    def _state(self, args: list) -> tuple[tuple, Any]:
        """This call's key and what has been done for it (None: first call, now warming up)."""
        ptrs = [args[i].data_ptr() if isinstance(args[i], Tensor) else None for i in self.static_positions]
        if self.static_ptrs is not None and ptrs != self.static_ptrs:
            self.record_fallback(reasons.CUDAGRAPH_STATIC_INPUT_MOVED)
            self._kept += [state for state in self.keys.values() if isinstance(state, _RecordedKey)]
            self.keys.clear()
        self.static_ptrs = ptrs
        key = self._key(args)
        state = self.keys.get(key)
        if state is None:
            self.keys[key] = _WARMED
            self.record_fallback(reasons.CUDAGRAPH_WARMUP)
        elif state is _FAILED:
            self.record_fallback(reasons.CUDAGRAPH_RECORD_FAILED)
        return key, state

    # ----------------------------------------------------------------------------------------------

    def _run_plain(self, env: dict) -> None:
        for step, fn in self.steps:
            if fn is None:
                self._run_eager(step.node, env)
            else:
                env.update(zip(step.outputs, fn([env[n] for n in step.inputs])))

    @staticmethod
    def _run_eager(node: Node, env: dict) -> None:
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
        env[node] = node.target(*args, **kwargs)

    def _capture(self, fn: RegionFn, args: list, recorded: _RecordedKey) -> tuple[Any, list]:
        """Record ``fn(args)`` in a CUDA graph of this region's pool, then replay it (recording
        computes nothing, and this forward needs the values). Recorded on a side stream: the
        default stream cannot record."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        recorded.graphs.append(graph)  # alive even if this recording fails
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                outputs = fn(list(args))
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        graph.replay()
        return graph, outputs

    _alias = staticmethod(non_owning)

    def _record(self, env: dict) -> _RecordedKey:
        recorded, produced = _RecordedKey(), set()
        self._kept.append(recorded)  # dropped once the key has recorded fully
        for step, fn in self.steps:
            if fn is None:
                self._run_eager(step.node, env)
                continue
            if step.views_only:  # no kernel: run it directly; its views move only with its inputs
                outputs = fn([env[n] for n in step.inputs])
                env.update(zip(step.outputs, outputs))
                recorded.pieces.append(None)
                inputs = {env[n].untyped_storage().data_ptr() for n in step.inputs if isinstance(env[n], Tensor)}
                if all(n in produced or n in self.static for n in step.inputs) and all(
                        o.untyped_storage().data_ptr() in inputs for o in outputs if isinstance(o, Tensor)):
                    produced.update(step.outputs)
                continue
            args, staged = [], []
            for i, node in enumerate(step.inputs):
                value = env[node]
                if isinstance(value, Tensor) and node not in self.static and node not in produced:
                    view = self.staging.view(i, value)
                    view.copy_(value)
                    staged.append((node, view))
                    value = view
                args.append(value)
            graph, outputs = self._capture(fn, args, recorded)
            copy_out = [j for j, o in enumerate(outputs) if isinstance(o, Tensor) and self.staging.owns(o)]
            recorded.pieces.append(_RecordedPiece(
                graph, staged, [self._alias(o) if isinstance(o, Tensor) else o for o in outputs], copy_out))
            outputs = [_copy(o) if j in copy_out else o for j, o in enumerate(outputs)]
            env.update(zip(step.outputs, outputs))  # owning: alive until this forward ends
            # A copied-out value gets a new address each replay: its readers stage it.
            produced.update(n for j, n in enumerate(step.outputs) if j not in copy_out)
        self._kept.pop()
        return recorded

    def _replay(self, recorded: _RecordedKey, env: dict) -> None:
        pieces = iter(recorded.pieces)
        for step, fn in self.steps:
            if fn is None:
                self._run_eager(step.node, env)
                continue
            piece = next(pieces)
            if piece is None:
                env.update(zip(step.outputs, fn([env[n] for n in step.inputs])))
                continue
            for node, view in piece.staged:
                value = env[node]
                if value.data_ptr() != view.data_ptr():
                    view.copy_(value)
            piece.graph.replay()
            outputs = piece.outputs
            if piece.copy_out:
                outputs = [_copy(o) if j in piece.copy_out else o for j, o in enumerate(outputs)]
            env.update(zip(step.outputs, outputs))
