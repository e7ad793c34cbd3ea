"""Narrow a tensor that the two regions read in disjoint slices: each computes only its own slice.

Gemma 3n and Gemma 4 compute every layer's per-layer input up front, for all tokens: one product
``[T, L * P]`` (plus an embedding of the same width), viewed ``[T, L, P]``; layer ``i`` reads
``[:, i]``. After the hoist, the slices of the KV-sharing layers are read only in the reduced
region, yet the product was computed for all ``T`` rows and all ``L`` layers (so it is in the
example's hand-written split, ``Gemma3nLike(hand_split=True)``). This pass splits such a tensor into the slice the full
region reads and the slice the reduced region reads, and pushes each slice up its producer chain
to the weights (rows of a projection, columns of an embedding table). Run again, the analysis then
hoists the reduced slice's whole chain past the gather: the shared layers' columns cost ``R``
rows, the others' ``T`` rows, instead of every column for ``T`` rows.

Invariants:
- Runs between the analysis and the cut, on the plan's boundary tensors only: every reader is a
  ``select`` or ``slice`` with constant bounds on one dim that is not the token dim, and the index
  ranges read in the full region and in the reduced region do not overlap.
- Values are unchanged: each push rule computes ``slice(op(x), d)`` as ``op'(slice(x, d'))`` (a
  view that splits that dim, pointwise ops with broadcasting, reductions over other dims, ``mm``'s
  columns, ``embedding``'s columns, permutes); a producer without a rule is sliced where it stands.
- No recomputation: a producer is rebuilt narrower only when every reader of it is rebuilt and
  reads it through a slice; any other producer is computed once, whole, and sliced. A tensor is
  split only where a push narrows a product or an embedding; otherwise the graph is left as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.fx import GraphModule, Node

from .fake_values import refresh_fake_values
from .fx_utils import is_open_end, is_whole_slice, slice_args
from .gather_hoisting import HoistPlan
from .token_layout import shape_exprs

aten = torch.ops.aten
prims = torch.ops.prims

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default)
_UNARY = (aten._to_copy.default, aten.alias.default)


@dataclass
class Narrowed:
    """A tensor that was split: the dim its readers slice, and the index range each region reads."""
    tensor: Node  # erased from the graph; kept for its shape and source in the report
    dim: int
    reduced: tuple[int, int]
    full: tuple[int, int]


def _int_size(expr: sympy.Expr) -> int | None:
    return int(expr) if expr.is_Integer else None


def _read_range(user: Node, tensor: Node, shape: list[sympy.Expr]) -> tuple[int, int, int] | None:
    """(dim, start, end) of the constant index range a select or a unit-step slice of ``tensor`` reads."""
    if user.op != "call_function" or not user.args or user.args[0] is not tensor:
        return None
    if user.target is aten.select.int and len(user.args) == 3:
        dim, index = user.args[1] % len(shape), user.args[2]
        size = _int_size(shape[dim])
        if size is None or not isinstance(index, int):
            return None
        index = index + size if index < 0 else index
        return dim, index, index + 1
    if user.target is aten.slice.Tensor:
        dim, start, end, step = slice_args(user)
        dim = dim % len(shape)
        size = _int_size(shape[dim])
        start = 0 if start is None else start
        end = size if is_open_end(end) else end
        if (
            size is not None
            and isinstance(start, int)
            and isinstance(end, int)
            and step in (None, 1)
            and 0 <= start < end <= size
        ):
            return dim, start, end
    return None


def _is_identity_slice(node: Node) -> bool:
    """``x[:, :]``-style slices (``per_layer[:, i]`` traces as one, then a select): every index."""
    return node.op == "call_function" and node.target is aten.slice.Tensor and is_whole_slice(node)


def _readers(tensor: Node) -> list[tuple[Node, Node]]:
    """(reader, what it reads) pairs, looking through identity slices."""
    pairs = []
    for user in tensor.users:
        if _is_identity_slice(user) and user.args[0] is tensor:
            pairs.extend((inner, user) for inner in user.users)
        else:
            pairs.append((user, tensor))
    return pairs


def _disjoint_reads(tensor: Node, token_axis: int, region: dict) -> tuple[Narrowed, dict] | None:
    """The dim the readers slice and the two regions' ranges, when those are disjoint; with each
    reader's (what it reads, (dim, start, end))."""
    shape = shape_exprs(tensor.meta.get("val"))
    if not shape or not tensor.users:
        return None
    reads = {user: (via, _read_range(user, via, shape)) for user, via in _readers(tensor)}
    if any(r is None for _, r in reads.values()) or len({r[0] for _, r in reads.values()}) != 1:
        return None
    # An identity slice is rewired as a whole: all its readers must be on one side.
    for via in {v for v, _ in reads.values() if v is not tensor}:
        if len({u in region for u, (v, _) in reads.items() if v is via}) != 1:
            return None
    dim = next(iter(reads.values()))[1][0]
    ranges = {side: [r[1:] for u, (_, r) in reads.items() if (u in region) == side] for side in (True, False)}
    if dim == token_axis or not ranges[True] or not ranges[False]:
        return None
    reduced = (min(s for s, _ in ranges[True]), max(e for _, e in ranges[True]))
    full = (min(s for s, _ in ranges[False]), max(e for _, e in ranges[False]))
    if reduced[0] < full[1] and full[0] < reduced[1]:
        return None
    return Narrowed(tensor, dim, reduced, full), reads


@dataclass(frozen=True)
class _Request:
    """``node`` narrowed to ``[start, end)`` on ``dim``."""
    node: Node
    dim: int
    start: int
    end: int


@dataclass
class _Push:
    """How to compute a narrowed node from narrowed inputs: its args hold ``_Request``s."""
    target: Any
    args: tuple
    kwargs: dict
    narrows_weight: bool = False  # a product or an embedding made narrower


def _operand(arg, out_rank: int, dim: int, start: int, end: int):
    """An elementwise operand, aligned from the right: narrowed unless it broadcasts on ``dim``."""
    if not isinstance(arg, Node) or not isinstance(arg.meta.get("val"), torch.Tensor):
        return arg
    shape = shape_exprs(arg.meta["val"])
    axis = dim - (out_rank - len(shape))
    if axis < 0 or shape[axis] == 1:
        return arg
    return _Request(arg, axis, start, end)


def _view_push(node: Node, dim: int, start: int, end: int) -> _Push | None:
    """A view whose output dim ``dim`` (with every dim after it) is a whole block of the input from
    some input dim ``j`` on: the slice is a slice of dim ``j``, in units of that dim's inner size."""
    src, sizes = node.args[0], node.args[1]
    out, inp = shape_exprs(node.meta["val"]), shape_exprs(src.meta["val"])
    if not isinstance(sizes, (list, tuple)) or len(sizes) != len(out) or not isinstance(sizes[dim], int) \
            or sizes[dim] != out[dim] or not all(s.is_Integer for s in out[dim + 1:]):
        return None
    inner_out = math.prod(int(s) for s in out[dim + 1:])
    prefix_out = sympy.Mul(*out[:dim])
    for j in range(len(inp)):
        if not all(s.is_Integer for s in inp[j:]) or sympy.expand(sympy.Mul(*inp[:j]) - prefix_out) != 0:
            continue
        inner_in = math.prod(int(s) for s in inp[j + 1:])
        if inner_out % inner_in or int(inp[j]) * inner_in != int(out[dim]) * inner_out:
            continue
        scale = inner_out // inner_in
        new_sizes = list(sizes)
        new_sizes[dim] = end - start
        return _Push(node.target, (_Request(src, j, start * scale, end * scale), new_sizes), {})
    return None


def _push(node: Node, dim: int, start: int, end: int) -> _Push | None:
    """The rule for computing ``node`` narrowed on ``dim`` from narrowed inputs; None: no rule."""
    target, args, kwargs = node.target, node.args, dict(node.kwargs)
    rank = node.meta["val"].dim()
    if target in _VIEWS:
        return _view_push(node, dim, start, end)
    if target is aten.mm.default and dim == 1:
        return _Push(target, (args[0], _Request(args[1], 1, start, end)), kwargs, narrows_weight=True)
    if target is aten.addmm.default and dim == 1 and len(args) == 3:
        bias = _operand(args[0], rank, dim, start, end)
        return _Push(target, (bias, args[1], _Request(args[2], 1, start, end)), kwargs, narrows_weight=True)
    if target is aten.embedding.default and dim == rank - 1:
        return _Push(target, (_Request(args[0], 1, start, end), *args[1:]), kwargs, narrows_weight=True)
    if target is aten.permute.default:
        dims = [d % rank for d in args[1]]
        return _Push(target, (_Request(args[0], dims[dim], start, end), args[1]), kwargs)
    if target in (aten.t.default, aten.transpose.int):
        d0, d1 = (0, 1) if target is aten.t.default else (args[1] % rank, args[2] % rank)
        return _Push(target, (_Request(args[0], {d0: d1, d1: d0}.get(dim, dim), start, end), *args[1:]), kwargs)
    if target in _REDUCTIONS:
        src, dims = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
        if not dims and dims != 0:
            return None  # no dims (None or []): every dim is reduced
        src_rank = src.meta["val"].dim()
        reduced = {d % src_rank for d in ([dims] if isinstance(dims, int) else dims)}
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        source_dim = dim if keepdim else [d for d in range(src_rank) if d not in reduced][dim]
        if source_dim in reduced:
            return None
        return _Push(target, (_Request(src, source_dim, start, end), *args[1:]), kwargs)
    if torch.Tag.pointwise in getattr(target, "tags", ()) or target in _UNARY:
        if any(not isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
            return None  # a SymInt operand: leave it
        return _Push(target, tuple(_operand(a, rank, dim, start, end) for a in args), kwargs)
    return None


class _Narrower:
    """Builds slices of one tensor by pushing them up its producers.

    Planned first, emitted second: a producer is rebuilt narrower only when every reader of it is
    rebuilt too (a norm reads its input twice, ``x * rsqrt(mean(x * x))``: both reads are pushed);
    a producer with any other reader is sliced where it stands, since it is computed whole anyway.
    """

    def __init__(self, gm: GraphModule, root: Node, requests: list[_Request]):
        self.graph = gm.graph
        self.pushes: dict[_Request, _Push | None] = {}
        stack = list(requests)
        while stack:
            request = stack.pop()
            if request in self.pushes:
                continue
            node = request.node
            push = _push(node, request.dim, request.start, request.end) if node.op == "call_function" else None
            self.pushes[request] = push
            if push is not None:
                stack.extend(a for a in _flat(push.args) if isinstance(a, _Request))
        # Rebuild a producer only if every reader of it is rebuilt and reads it narrowed only
        # (otherwise it is computed whole anyway): a fixpoint, since dropping a reader drops its producers.
        self.kept = {r.node for r, p in self.pushes.items() if p is not None}
        changed = True
        while changed:
            changed = False
            for node in list(self.kept):
                if node is not root and not all(self._reads_narrowed(u, node) for u in node.users):
                    self.kept.discard(node)
                    changed = True
        self.built: dict[_Request, Node] = {}
        self.created: list[Node] = []
        self.narrowed_weights = 0

    def _reads_narrowed(self, reader: Node, node: Node) -> bool:
        """Whether ``reader`` is rebuilt and each of its planned pushes reads ``node`` only through a slice."""
        if reader not in self.kept:
            return False
        pushes = [p for r, p in self.pushes.items() if r.node is reader and p is not None]
        return all(not any(a is node for a in _flat(p.args)) for p in pushes)

    def build(self, request: _Request) -> Node:
        if request in self.built:
            return self.built[request]
        node = request.node
        if request.start == 0 and shape_exprs(node.meta["val"])[request.dim] == request.end:
            result = node
        elif node in self.kept and self.pushes[request] is not None:
            push = self.pushes[request]
            args = torch.fx.node.map_aggregate(push.args, lambda a: self.build(a) if isinstance(a, _Request) else a)
            result = self._emit(node, push.target, args, push.kwargs)
            self.narrowed_weights += push.narrows_weight
        else:
            result = self._emit(node, aten.slice.Tensor, (node, request.dim, request.start, request.end), {})
        self.built[request] = result
        return result

    def _emit(self, after: Node, target, args: tuple, kwargs: dict) -> Node:
        """A new node; its fake value is computed with its readers' once the split is done."""
        with self.graph.inserting_after(after):
            node = self.graph.call_function(target, args, kwargs)
        self.created.append(node)
        return node

    def rollback(self) -> None:
        for node in reversed(self.created):
            self.graph.erase_node(node)


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _reread(user: Node, source: Node, read: tuple[int, int, int], offset: int) -> None:
    """Point a select or slice at ``source``, whose index 0 is index ``offset`` of the old tensor."""
    dim, start, end = read
    if user.target is aten.select.int:
        user.args = (source, dim, start - offset)
    else:
        user.args = (source, dim, start - offset, end - offset)


def narrow_sliced_producers(gm: GraphModule, plan: HoistPlan) -> list[Narrowed]:
    """Split every boundary tensor the regions read in disjoint slices; returns what was split
    (run the analysis again when anything was)."""
    split, changed = [], []
    for (tensor, layout) in list(plan.boundary):
        if sum(t is tensor for t, _ in plan.boundary) != 1 or tensor.op != "call_function":
            continue
        found = _disjoint_reads(tensor, layout.axis, plan.region)
        if found is None:
            continue
        reads, per_user = found
        requests = {
            region: _Request(tensor, reads.dim, *span) for region, span in ((True, reads.reduced), (False, reads.full))
        }
        narrower = _Narrower(gm, tensor, list(requests.values()))
        parts = {region: narrower.build(request) for region, request in requests.items()}
        if not narrower.narrowed_weights:
            narrower.rollback()
            continue
        for user, (via, read) in per_user.items():
            in_region = user in plan.region
            part = parts[in_region]
            if via is not tensor:  # an identity slice: slice the part instead
                if via.args[0] is tensor:
                    via.args = (part, *via.args[1:])
                part = via
            _reread(user, part, read, (reads.reduced if in_region else reads.full)[0])
        changed += narrower.created + list(per_user)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in sorted(narrower.kept, key=order.__getitem__, reverse=True):  # readers before producers
            if not node.users:
                gm.graph.erase_node(node)
        split.append(reads)
    if split:
        gm.graph.lint()
        gm.recompile()
        # The new nodes, and every reader downstream: a reader keeps its shape but takes the part's
        # strides, and Inductor compiles to the strides.
        refresh_fake_values(gm, changed)
    return split
