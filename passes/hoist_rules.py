"""Transfer rules for hoisting a row gather upstream through one aten op.

A rule answers: to compute ``node[rows]`` (rows selected on ``layout``), which rows of which inputs
are needed? Each tensor input is either row-aligned (gathered on a layout of its own) or needed
whole (weights, broadcast operands, attention K/V). An op without a rule stops the hoist.

Invariants:
- A rule never claims row-alignment it cannot show from shapes: sizes are compared as sympy
  expressions, and any argument that depends on the row count in a way the rule cannot rewrite
  stops the hoist.
- Only the token dim shrinks. A size or slice bound off the token dim keeps its value in the
  reduced region, even where it is the token count (the keys of a score matrix ``[R, T]``, a mask
  sliced to ``T`` keys): those dims are not gathered.
- Collectives (``torch.distributed``'s functional ops, what tensor parallelism traces to) are
  row-wise when they combine or copy ranks' tensors element by element (all-reduce, broadcast,
  wait) or concatenate them on a dim that is not the token dim (all-gather, reduce-scatter on dim
  0): every rank gathers the same rows (the row selection is computed from replicated inputs, and
  ranks check they planned the same cut, compilation/spmd.py), so the collective of the gathered
  rows is the gathered rows of the collective. Over the token dim (sequence parallelism) they stop.
- Rules only describe; the rewrite (passes/cut_graph.py) applies ``arg_rewrites`` (sizes in the
  reduced row count, sizes of the full graph given as sympy expressions, the sdpa op's
  ``query_suffix`` flag) and ``set_query_rows`` to nodes that join the reduced region.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
from torch.fx import Node

from fx_fastprefill.ops.schema import (ATTENTION_OP, K, KV_WRITTEN, Q, QUERY_ROWS, SDPA_IS_CAUSAL, SDPA_K, SDPA_MASK,
                                       SDPA_OP, SDPA_Q, SDPA_QUERY_SUFFIX, SDPA_V, V)

from .fx_utils import reaches_end
from .sorted_dispatch import sorted_dispatch
from .token_layout import Layout, depends_on, is_factor, map_view_layout, shape_exprs

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

Path = tuple  # ("args", i) or ("args", i, j) or ("kwargs", name)
REDUCED_SIZE = "reduced_size"  # marker: this size argument is re-expressed in the reduced row count


@dataclass
class Requirement:
    path: Path
    node: Node
    layout: Layout | None  # None: needed whole
    user: Node | None = None  # whose argument ``path`` is, when not the rule's node (a block rule's)


@dataclass
class RuleResult:
    requirements: list[Requirement] = field(default_factory=list)
    arg_rewrites: dict[Path, Any] = field(default_factory=dict)
    set_query_rows: bool = False
    # A block rule's other nodes (passes/sorted_dispatch.py): they join the region with this node.
    absorbed: dict[Node, "RuleResult"] = field(default_factory=dict)


RuleFn = Callable[[Node, Layout, sympy.Symbol], "RuleResult | str"]
RULES: dict[Any, RuleFn] = {}


def rule(*targets):
    def register(fn: RuleFn) -> RuleFn:
        for target in targets:
            RULES[target] = fn
        return fn
    return register


def _shape(node: Node) -> list[sympy.Expr]:
    return shape_exprs(node.meta.get("val")) or []


def _norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def tensor_args(node: Node):
    """(path, node) of every tensor-valued FX node among the arguments."""
    for i, arg in enumerate(node.args):
        if isinstance(arg, Node):
            yield ("args", i), arg
        elif isinstance(arg, (list, tuple)):
            for j, item in enumerate(arg):
                if isinstance(item, Node):
                    yield ("args", i, j), item
    for name, arg in node.kwargs.items():
        if isinstance(arg, Node):
            yield ("kwargs", name), arg


def _is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _symint_uses_rows(node: Node, rows: sympy.Symbol) -> str | None:
    for path, arg in tensor_args(node):
        if not _is_tensor(arg) and depends_on(arg, rows):
            return f"argument {path[1:]} is a size computed from the token count"
    return None


def _broadcast_requirement(path, arg: Node, out_shape, layout: Layout) -> Requirement | str:
    """Elementwise operand: aligned from the right, row-aligned or broadcast (needed whole)."""
    shape = _shape(arg)
    axis = layout.axis - (len(out_shape) - len(shape))
    if axis < 0 or (shape[axis] == 1 and out_shape[layout.axis] != 1):
        return Requirement(path, arg, None)
    if sympy.simplify(shape[axis] - out_shape[layout.axis]) != 0:
        return f"operand {path[1:]} has {shape[axis]} rows on the token dim, output has {out_shape[layout.axis]}"
    return Requirement(path, arg, layout.moved(axis))


def _elementwise(node: Node, layout: Layout, rows) -> RuleResult | str:
    reason = _symint_uses_rows(node, rows)
    if reason:
        return reason
    out_shape = _shape(node)
    result = RuleResult()
    for path, arg in tensor_args(node):
        if not _is_tensor(arg):
            continue
        req = _broadcast_requirement(path, arg, out_shape, layout)
        if isinstance(req, str):
            return req
        result.requirements.append(req)
    return result


# Ops that are elementwise but carry no pointwise tag.
EXTRA_ELEMENTWISE = {
    prims.convert_element_type.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.copy.default, aten.where.self,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.empty_like.default, aten.fill.Scalar, aten.clamp.default,
}


def lookup_rule(node: Node) -> RuleFn | None:
    target = node.target
    if target in RULES:
        return RULES[target]
    if isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or target in EXTRA_ELEMENTWISE
    ):
        return _elementwise
    return None


@rule(aten.mm.default)
def _mm(node, layout, rows):
    x, w = node.args
    if layout.axis == 0:
        return RuleResult([Requirement(("args", 0), x, layout), Requirement(("args", 1), w, None)])
    return RuleResult([Requirement(("args", 0), x, None), Requirement(("args", 1), w, layout)])


@rule(aten.addmm.default)
def _addmm(node, layout, rows):
    if node.kwargs:
        return "addmm with beta/alpha"
    bias, x, w = node.args
    req = _broadcast_requirement(("args", 0), bias, _shape(node), layout)
    if isinstance(req, str):
        return req
    if layout.axis == 0:
        return RuleResult([req, Requirement(("args", 1), x, layout), Requirement(("args", 2), w, None)])
    return RuleResult([req, Requirement(("args", 1), x, None), Requirement(("args", 2), w, layout)])


@rule(aten.bmm.default)
def _bmm(node, layout, rows):
    return _bmm_operands(*node.args, layout, first=0)


@rule(aten.baddbmm.default)
def _baddbmm(node, layout, rows):
    """``beta * bias + alpha * x @ y`` (BLOOM's ALiBi scores): the product's rule, the bias
    broadcast against the output like an elementwise operand."""
    bias = node.args[0]
    req = _broadcast_requirement(("args", 0), bias, _shape(node), layout)
    if isinstance(req, str):
        return req
    result = _bmm_operands(node.args[1], node.args[2], layout, first=1)
    result.requirements.insert(0, req)
    return result


def _bmm_operands(x: Node, y: Node, layout: Layout, first: int) -> RuleResult:
    """A batched product's operands (args ``first`` and ``first + 1``): the batch dim in both, rows
    of the output in ``x``, columns in ``y``."""
    path_x, path_y = ("args", first), ("args", first + 1)
    if layout.axis == 0:  # batch dim: output batch i is x[i] @ y[i], whatever the grouping
        return RuleResult([Requirement(path_x, x, layout), Requirement(path_y, y, layout)])
    if layout.axis == 1:
        return RuleResult([Requirement(path_x, x, layout), Requirement(path_y, y, None)])
    return RuleResult([Requirement(path_x, x, None), Requirement(path_y, y, layout)])


def _rewrite_size_list(node: Node, arg_index: int, layout: Layout, rows) -> dict | str:
    """Sizes that depend on the token count get rewritten (cut_graph: T -> R in their expression);
    only the token dim may depend on it."""
    sizes = list(node.args[arg_index])
    rewrites = {}
    for i, size in enumerate(sizes):
        uses_rows = depends_on(size, rows)
        if i == layout.axis:
            if uses_rows or (rows.is_number and isinstance(size, int) and size != -1):
                # (static shapes: the token dim's size is a constant, outer * T * inner)
                rewrites[("args", arg_index, i)] = REDUCED_SIZE
            elif size != -1:
                return f"size {i} of {node.target} is a constant on the token dim"
        elif size == -1 and not _explicit_rows(sizes[layout.axis], rows):
            # cut_graph infers a token-dim size it cannot spell (-1): only one dim may be inferred.
            return f"{node.target} infers a dim other than the token dim (-1 at {i})"
    return rewrites


def _explicit_rows(size, rows) -> bool:
    """Whether cut_graph spells this token-dim size in R explicitly: ``rows`` times an integer."""
    value = size.meta.get("val") if isinstance(size, Node) else size
    if isinstance(value, int) and rows.is_number:
        return value != -1
    if not isinstance(value, torch.SymInt):
        return False
    factor = sympy.simplify(value.node.expr / rows)
    return factor.is_Integer


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(node, layout, rows):
    src = node.args[0]
    in_layout = map_view_layout(_shape(node), layout, _shape(src), rows)
    if in_layout is None:
        return "a view that splits or merges the token dim with a dim before it"
    rewrites = _rewrite_size_list(node, 1, layout, rows)
    if isinstance(rewrites, str):
        return rewrites
    return RuleResult([Requirement(("args", 0), src, in_layout)], rewrites)


@rule(aten.expand.default)
def _expand(node, layout, rows):
    """Row-aligned where the source has the rows; where it broadcasts one row over the token dim (a
    per-head sink logit expanded over the queries) the source is needed whole and the expanded
    size becomes the reduced row count."""
    src = node.args[0]
    out_shape, shape = _shape(node), _shape(src)
    axis = layout.axis - (len(out_shape) - len(shape))
    if axis >= 0 and shape[axis] == 1 and out_shape[layout.axis] != 1 and layout.plain:
        rewrites = _rewrite_size_list(node, 1, layout, rows)
        if isinstance(rewrites, str):
            return rewrites
        return RuleResult([Requirement(("args", 0), src, None)], rewrites)
    if axis < 0 or sympy.simplify(shape[axis] - out_shape[layout.axis]) != 0:
        return "expand creates the token dim"
    rewrites = _rewrite_size_list(node, 1, layout, rows)
    if isinstance(rewrites, str):
        return rewrites
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis))], rewrites)


@rule(aten.repeat.default)
def _repeat(node, layout, rows):
    """Off the token dim, row-aligned. Along it, ``n`` copies of the rows one after the other (a
    Llama-4-style MoE feeds every expert all rows as ``x.repeat(E, 1)``): element ``i`` is the
    source's ``i mod S``, so rows asked for in ``outer`` groups are the source's rows in ``outer / n``
    groups, when ``n`` divides ``outer`` (the reader views the copies apart, ``[E*T, H] -> [E, T, H]``)."""
    src, repeats = node.args
    axis = layout.axis - (len(repeats) - len(_shape(src)))
    if any(depends_on(r, rows) for r in repeats):
        return "repeat counts depend on the token count"
    copies = repeats[layout.axis]
    if axis < 0:
        return "repeat adds the token dim"
    if copies == 1:
        return RuleResult([Requirement(("args", 0), src, layout.moved(axis))])
    outer = sympy.simplify(layout.outer / copies)
    if not isinstance(copies, int) or not is_factor(outer, rows):
        return "repeat along the token dim whose copies are not read apart"
    return RuleResult([Requirement(("args", 0), src, Layout(axis, layout.inner, outer))])


@rule(aten.permute.default)
def _permute(node, layout, rows):
    src, dims = node.args
    dims = [_norm_dim(d, len(dims)) for d in dims]
    return RuleResult([Requirement(("args", 0), src, layout.moved(dims[layout.axis]))])


@rule(aten.transpose.int)
def _transpose(node, layout, rows):
    src, d0, d1 = node.args
    rank = len(_shape(node))
    d0, d1 = _norm_dim(d0, rank), _norm_dim(d1, rank)
    axis = {d0: d1, d1: d0}.get(layout.axis, layout.axis)
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis))])


@rule(aten.unsqueeze.default)
def _unsqueeze(node, layout, rows):
    src, dim = node.args
    dim = _norm_dim(dim, len(_shape(node)))
    if dim == layout.axis:
        return "unsqueeze at the token dim"
    return RuleResult([Requirement(("args", 0), src, layout.moved(layout.axis - (dim < layout.axis)))])


@rule(aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(node, layout, rows):
    src = node.args[0]
    in_shape = _shape(src)
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    removed = sorted({_norm_dim(d, len(in_shape)) for d in dims if in_shape[_norm_dim(d, len(in_shape))] == 1})
    kept = [i for i in range(len(in_shape)) if i not in removed]
    return RuleResult([Requirement(("args", 0), src, layout.moved(kept[layout.axis]))])


@rule(aten.select.int)
def _select(node, layout, rows):
    src, dim, _ = node.args
    dim = _norm_dim(dim, len(_shape(src)))
    axis = layout.axis + (dim <= layout.axis)
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis))])


@rule(aten.slice.Tensor)
def _slice(node, layout, rows):
    src = node.args[0]
    shape = _shape(src)
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    if dim == layout.axis and not (start in (None, 0) and step == 1 and reaches_end(end, shape[dim])):
        return "a slice of the token dim"
    return RuleResult([Requirement(("args", 0), src, layout)])


@rule(aten.slice_scatter.default)
def _slice_scatter(node, layout, rows):
    """``x[.., a:b, ..] = src`` off the token dim: both keep the token dim where it is."""
    src, values = node.args[0], node.args[1]
    shape = _shape(src)
    dim = _norm_dim(node.args[2] if len(node.args) > 2 else 0, len(shape))
    if dim == layout.axis:
        return "a slice_scatter along the token dim"
    return RuleResult([Requirement(("args", 0), src, layout), Requirement(("args", 1), values, layout)])


@rule(aten.select_scatter.default)
def _select_scatter(node, layout, rows):
    src, values, dim = node.args[0], node.args[1], node.args[2]
    dim = _norm_dim(dim, len(_shape(src)))
    if dim == layout.axis:
        return "a select_scatter along the token dim"
    return RuleResult([Requirement(("args", 0), src, layout),
                       Requirement(("args", 1), values, layout.moved(layout.axis - (dim < layout.axis)))])


@rule(aten.cat.default)
def _cat(node, layout, rows):
    tensors = node.args[0]
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(_shape(node)))
    if dim == layout.axis:
        return "cat along the token dim"
    out_shape = _shape(node)
    result = RuleResult()
    for j, t in enumerate(tensors):
        shape = _shape(t)
        if len(shape) != len(out_shape):  # legacy empty tensor in cat
            return "cat of tensors of different ranks"
        result.requirements.append(Requirement(("args", 0, j), t, layout))
    return result


def _reduction(node, layout, rows, dims, keepdim):
    src = node.args[0]
    rank = len(_shape(src))
    dims = list(range(rank)) if dims is None or dims == [] else [_norm_dim(d, rank) for d in dims]
    kept = list(range(rank)) if keepdim else [i for i in range(rank) if i not in dims]
    axis = kept[layout.axis]
    if axis in dims:
        return "a reduction over the token dim"
    reason = _symint_uses_rows(node, rows)
    if reason:
        return reason
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis))])


@rule(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.prod.dim_int)
def _reduce_dims(node, layout, rows):
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return _reduction(node, layout, rows, dims, keepdim)


@rule(aten.max.dim, aten.min.dim)
def _max_dim(node, layout, rows):
    """(values, indices) over one dim, reached through getitem."""
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return _reduction(node, layout, rows, [node.args[1]], keepdim)


@rule(aten.var.correction, aten.var_mean.correction)
def _var(node, layout, rows):
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return _reduction(node, layout, rows, dims, node.kwargs.get("keepdim", False))


@rule(aten._softmax.default, aten._log_softmax.default)
def _softmax(node, layout, rows):
    src, dim = node.args[0], node.args[1]
    if _norm_dim(dim, len(_shape(src))) == layout.axis:
        return "softmax over the token dim"
    return RuleResult([Requirement(("args", 0), src, layout)])


@rule(aten.embedding.default)
def _embedding(node, layout, rows):
    weight, indices = node.args[0], node.args[1]
    if layout.axis >= len(_shape(indices)):
        return "embedding with rows on the feature dim"
    return RuleResult([Requirement(("args", 0), weight, None), Requirement(("args", 1), indices, layout)])


@rule(aten.index_select.default)
def _index_select(node, layout, rows):
    src, dim, index = node.args
    if _norm_dim(dim, len(_shape(src))) == layout.axis:
        return "index_select along the token dim"
    return RuleResult([Requirement(("args", 0), src, layout), Requirement(("args", 2), index, None)])


@rule(aten.index.Tensor)
def _index(node, layout, rows):
    """``src[..., idx, ...]`` by one index tensor at dim ``d``: the output's dims ``d .. d + idx.dim()``
    are the index's. Rows there are the index's rows (a table looked up per row: an embedding, MoE
    expert weights by each row's expert ids); the looked-up tensor is needed whole. Rows elsewhere
    are the source's rows, the index whole. An index that undoes a sort is a block of its own
    (passes/sorted_dispatch.py)."""
    block = sorted_dispatch(node, layout, rows, lookup_rule)
    if block is not None:
        return block
    src, indices = node.args
    picked = [(d, ix) for d, ix in enumerate(indices) if ix is not None]
    if len(picked) != 1 or not isinstance(picked[0][1], Node):
        return "advanced indexing by more than one index tensor"
    d, index = picked[0]
    width = len(_shape(index))
    if d <= layout.axis < d + width:
        return RuleResult([Requirement(("args", 0), src, None),
                           Requirement(("args", 1, d), index, layout.moved(layout.axis - d))])
    axis = layout.axis if layout.axis < d else layout.axis - width + 1
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis)), Requirement(("args", 1, d), index, None)])


@rule(aten.gather.default)
def _gather(node, layout, rows):
    """``out[..i..][j] = src[..i..][index[..i..][j]]`` along another dim than the token dim (a router
    picking its experts' scores per row): the output's rows are the source's and the index's."""
    src, dim, index = node.args[:3]
    rank = len(_shape(src))
    if _norm_dim(dim, rank) == layout.axis:
        return "gather along the token dim"
    if sympy.simplify(_shape(src)[layout.axis] - _shape(node)[layout.axis]) != 0:
        return "gather of fewer rows than its source"
    return RuleResult([Requirement(("args", 0), src, layout), Requirement(("args", 2), index, layout)])


@rule(aten.scatter.value, aten.scatter.src, aten.scatter_add.default, aten.scatter_reduce.two)
def _scatter(node, layout, rows):
    """``out = self; out[..i..][index[..i..][j]] = src[..i..][j]`` along another dim than the token
    dim (a router's mask of chosen experts or groups): row-aligned, every operand on the same rows."""
    dim = node.args[1]
    if _norm_dim(dim, len(_shape(node))) == layout.axis:
        return "scatter along the token dim"
    result = RuleResult()
    for i in (0, 2, 3):
        arg = node.args[i] if len(node.args) > i else None
        if not isinstance(arg, Node):
            continue
        if sympy.simplify(_shape(arg)[layout.axis] - _shape(node)[layout.axis]) != 0:
            return f"scatter whose operand {i} has other rows than its output"
        result.requirements.append(Requirement(("args", i), arg, layout))
    return result


@rule(aten.topk.default, aten.sort.default, aten.sort.stable)
def _along_one_dim(node, layout, rows):
    """top-k or sort within each row (a router's top-k experts): row-wise unless along the token dim."""
    src = node.args[0]
    if node.target is aten.topk.default:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    elif node.target is aten.sort.stable:
        dim = node.kwargs.get("dim", -1)
    else:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    if _norm_dim(dim, len(_shape(src))) == layout.axis:
        return f"{node.target} along the token dim"
    return RuleResult([Requirement(("args", 0), src, layout)])


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.native_layer_norm.default)
def _multi_output(node, layout, rows):
    src = node.args[0]
    if node.target is not aten.native_layer_norm.default:
        dim = node.args[2] if len(node.args) > 2 else 0
        if _norm_dim(dim, len(_shape(src))) == layout.axis:
            return "split along the token dim"
        return RuleResult([Requirement(("args", 0), src, layout)])
    result = RuleResult([Requirement(("args", 0), src, layout)])
    for i in (2, 3):
        if isinstance(node.args[i], Node):
            result.requirements.append(Requirement(("args", i), node.args[i], None))
    return result


@rule(operator.getitem)
def _getitem(node, layout, rows):
    return RuleResult([Requirement(("args", 0), node.args[0], layout)])


@rule(ATTENTION_OP)
def _attention(node, layout, rows):
    if layout.axis != 0 or not layout.plain:
        return "attention output rows merged with another dim"
    if node.args[QUERY_ROWS] is not None:
        return "attention already runs on a subset of its queries"
    if node.args[KV_WRITTEN] is None:
        return "attention that writes its own cache (run passes/link_kv_sources.py first)"
    result = RuleResult([Requirement(("args", Q), node.args[Q], layout)], set_query_rows=True)
    for i in (K, V, KV_WRITTEN):
        result.requirements.append(Requirement(("args", i), node.args[i], None))
    return result


@rule(SDPA_OP)
def _sdpa(node, layout, rows):
    """Queries are row-aligned on their dim -2; K/V are needed whole; a mask is gathered on its
    query dim unless it broadcasts there. The rewritten call runs on a suffix of the queries."""
    out_shape = _shape(node)
    if layout.axis != len(out_shape) - 2 or not layout.plain:
        return "attention output rows not on its query dim"
    if node.args[SDPA_QUERY_SUFFIX]:
        return "attention already runs on a subset of its queries"
    q, k, v, mask = (node.args[i] for i in (SDPA_Q, SDPA_K, SDPA_V, SDPA_MASK))
    rewrites = {("args", SDPA_QUERY_SUFFIX): True}
    if node.args[SDPA_IS_CAUSAL] and sympy.simplify(_shape(q)[-2] - _shape(k)[-2]) != 0:
        # Top-left causal over more keys than queries (a static cache's slots): the suffix call is
        # told the full call's query count, and aligns its queries as their last rows.
        # (A keyword: the aten trace drops the trailing default, and Inductor matches positions.)
        rewrites[("kwargs", "causal_queries")] = _shape(q)[-2]
    result = RuleResult([Requirement(("args", SDPA_Q), q, layout), Requirement(("args", SDPA_K), k, None),
                         Requirement(("args", SDPA_V), v, None)], rewrites)
    if isinstance(mask, Node):
        mask_shape = _shape(mask)
        if len(mask_shape) < 2 or mask_shape[-2] == 1:
            result.requirements.append(Requirement(("args", SDPA_MASK), mask, None))
        elif sympy.simplify(mask_shape[-2] - out_shape[layout.axis]) == 0:
            result.requirements.append(Requirement(("args", SDPA_MASK), mask, Layout(len(mask_shape) - 2)))
        else:
            return f"attention mask of shape {mask_shape} does not match the queries"
    return result


@rule(c10d.all_reduce.default, c10d.broadcast.default, c10d.wait_tensor.default)
def _rowwise_collective(node, layout, rows):
    """Element by element across ranks: the output's rows are the input's rows."""
    return RuleResult([Requirement(("args", 0), node.args[0], layout)])


@rule(c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
def _dim0_collective(node, layout, rows):
    """Ranks' tensors concatenated (or reduced and scattered) on dim 0: row-wise when the token rows
    are on another dim. On dim 0 it is sequence parallelism: the ranks hold different tokens."""
    if layout.axis == 0:
        return f"{node.target.name()} over the token dim (sequence parallelism: ranks hold different rows)"
    return RuleResult([Requirement(("args", 0), node.args[0], layout)])
