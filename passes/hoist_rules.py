"""Transfer rules for hoisting a row gather upstream through one aten op: elementwise ops,
products, views and shape ops, slices, concatenation, reductions, softmax, multi-output ops.
Types and registry: ``rule_registry.py``; importing this module registers every rule.

Invariants:
- A rule never claims row-alignment it cannot show from shapes: sizes are compared as sympy
  expressions, and any argument that depends on the row count in a way the rule cannot rewrite
  stops the hoist.
- Only the token dim shrinks. A size or slice bound off the token dim keeps its value in the
  reduced region, even where it is the token count (the keys of a score matrix ``[R, T]``, a mask
  sliced to ``T`` keys): those dims are not gathered.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch.fx import Node

from . import attention_rules, collective_rules, index_rules  # noqa: F401  (they register their rules)
from .fx_utils import arg, arg_position, reaches_end, slice_args
from .rule_registry import (POINTWISE, REDUCED_SIZE, RULES, Requirement, RuleResult, broadcast_requirement,
                            is_tensor, lookup_rule, norm_dim, rule, shape_of, symint_uses_rows, tensor_args)
from .token_layout import Layout, depends_on, is_factor, map_view_layout, same_size

__all__ = ["REDUCED_SIZE", "RULES", "Requirement", "RuleResult", "lookup_rule"]

aten = torch.ops.aten


@rule(POINTWISE)
def _elementwise(node: Node, layout: Layout, rows) -> RuleResult | str:
    reason = symint_uses_rows(node, rows)
    if reason:
        return reason
    out_shape = shape_of(node)
    result = RuleResult()
    for path, operand in tensor_args(node):
        if not is_tensor(operand):
            continue
        req = broadcast_requirement(path, operand, out_shape, layout)
        if isinstance(req, str):
            return req
        result.requirements.append(req)
    return result


@rule(aten.mm.default)
def _mm(node, layout, rows):
    x, w = arg(node, "self"), arg(node, "mat2")
    if layout.axis == 0:
        return RuleResult([Requirement(("args", 0), x, layout), Requirement(("args", 1), w, None)])
    return RuleResult([Requirement(("args", 0), x, None), Requirement(("args", 1), w, layout)])


@rule(aten.addmm.default)
def _addmm(node, layout, rows):
    if node.kwargs:
        return "addmm with beta/alpha"
    bias, x, w = arg(node, "self"), arg(node, "mat1"), arg(node, "mat2")
    req = broadcast_requirement(("args", 0), bias, shape_of(node), layout)
    if isinstance(req, str):
        return req
    if layout.axis == 0:
        return RuleResult([req, Requirement(("args", 1), x, layout), Requirement(("args", 2), w, None)])
    return RuleResult([req, Requirement(("args", 1), x, None), Requirement(("args", 2), w, layout)])


@rule(aten.bmm.default)
def _bmm(node, layout, rows):
    return _bmm_operands(arg(node, "self"), arg(node, "mat2"), layout, first=0)


@rule(aten.baddbmm.default)
def _baddbmm(node, layout, rows):
    """``beta * bias + alpha * x @ y`` (BLOOM's ALiBi scores): the product's rule, the bias
    broadcast against the output like an elementwise operand."""
    bias = arg(node, "self")
    req = broadcast_requirement(("args", 0), bias, shape_of(node), layout)
    if isinstance(req, str):
        return req
    result = _bmm_operands(arg(node, "batch1"), arg(node, "batch2"), layout, first=1)
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


def _rewrite_size_list(node: Node, layout: Layout, rows) -> dict | str:
    """Sizes (the ``size`` argument) that depend on the token count get rewritten (cut_graph: T -> R
    in their expression); only the token dim may depend on it."""
    sizes, arg_index = list(arg(node, "size")), arg_position(node.target, "size")
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
    src = arg(node, "self")
    in_layout = map_view_layout(shape_of(node), layout, shape_of(src), rows)
    if in_layout is None:
        return "a view that splits or merges the token dim with a dim before it"
    rewrites = _rewrite_size_list(node, layout, rows)
    if isinstance(rewrites, str):
        return rewrites
    return RuleResult([Requirement(("args", 0), src, in_layout)], rewrites)


@rule(aten.expand.default)
def _expand(node, layout, rows):
    """Row-aligned where the source has the rows; where it broadcasts one row over the token dim (a
    per-head sink logit expanded over the queries) the source is needed whole and the expanded
    size becomes the reduced row count."""
    src = arg(node, "self")
    out_shape, shape = shape_of(node), shape_of(src)
    axis = layout.axis - (len(out_shape) - len(shape))
    if axis >= 0 and shape[axis] == 1 and out_shape[layout.axis] != 1 and layout.plain:
        rewrites = _rewrite_size_list(node, layout, rows)
        if isinstance(rewrites, str):
            return rewrites
        return RuleResult([Requirement(("args", 0), src, None)], rewrites)
    if axis < 0 or not same_size(shape[axis], out_shape[layout.axis]):
        return "expand creates the token dim"
    rewrites = _rewrite_size_list(node, layout, rows)
    if isinstance(rewrites, str):
        return rewrites
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis))], rewrites)


@rule(aten.repeat.default)
def _repeat(node, layout, rows):
    """Off the token dim, row-aligned. Along it, ``n`` copies of the rows one after the other (a
    Llama-4-style MoE feeds every expert all rows as ``x.repeat(E, 1)``): element ``i`` is the
    source's ``i mod S``, so rows asked for in ``outer`` groups are the source's rows in ``outer / n``
    groups, when ``n`` divides ``outer`` (the reader views the copies apart, ``[E*T, H] -> [E, T, H]``)."""
    src, repeats = arg(node, "self"), arg(node, "repeats")
    axis = layout.axis - (len(repeats) - len(shape_of(src)))
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
    src, dims = arg(node, "self"), arg(node, "dims")
    dims = [norm_dim(d, len(dims)) for d in dims]
    return RuleResult([Requirement(("args", 0), src, layout.moved(dims[layout.axis]))])


@rule(aten.transpose.int)
def _transpose(node, layout, rows):
    src, d0, d1 = arg(node, "self"), arg(node, "dim0"), arg(node, "dim1")
    rank = len(shape_of(node))
    d0, d1 = norm_dim(d0, rank), norm_dim(d1, rank)
    axis = {d0: d1, d1: d0}.get(layout.axis, layout.axis)
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis))])


@rule(aten.unsqueeze.default)
def _unsqueeze(node, layout, rows):
    src, dim = arg(node, "self"), arg(node, "dim")
    dim = norm_dim(dim, len(shape_of(node)))
    if dim == layout.axis:
        return "unsqueeze at the token dim"
    return RuleResult([Requirement(("args", 0), src, layout.moved(layout.axis - (dim < layout.axis)))])


@rule(aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(node, layout, rows):
    src, dims = arg(node, "self"), arg(node, "dim")
    in_shape = shape_of(src)
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    removed = sorted({norm_dim(d, len(in_shape)) for d in dims if in_shape[norm_dim(d, len(in_shape))] == 1})
    kept = [i for i in range(len(in_shape)) if i not in removed]
    return RuleResult([Requirement(("args", 0), src, layout.moved(kept[layout.axis]))])


@rule(aten.select.int)
def _select(node, layout, rows):
    src, dim = arg(node, "self"), arg(node, "dim")
    dim = norm_dim(dim, len(shape_of(src)))
    axis = layout.axis + (dim <= layout.axis)
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis))])


@rule(aten.slice.Tensor)
def _slice(node, layout, rows):
    src = arg(node, "self")
    shape = shape_of(src)
    dim, start, end, step = slice_args(node)
    dim = norm_dim(dim, len(shape))
    if dim == layout.axis and not (start in (None, 0) and step == 1 and reaches_end(end, shape[dim])):
        return "a slice of the token dim"
    return RuleResult([Requirement(("args", 0), src, layout)])


@rule(aten.slice_scatter.default)
def _slice_scatter(node, layout, rows):
    """``x[.., a:b, ..] = src`` off the token dim: both keep the token dim where it is."""
    src, values = arg(node, "self"), arg(node, "src")
    shape = shape_of(src)
    dim = norm_dim(arg(node, "dim"), len(shape))
    if dim == layout.axis:
        return "a slice_scatter along the token dim"
    return RuleResult([Requirement(("args", 0), src, layout), Requirement(("args", 1), values, layout)])


@rule(aten.select_scatter.default)
def _select_scatter(node, layout, rows):
    src, values, dim = arg(node, "self"), arg(node, "src"), arg(node, "dim")
    dim = norm_dim(dim, len(shape_of(src)))
    if dim == layout.axis:
        return "a select_scatter along the token dim"
    return RuleResult([Requirement(("args", 0), src, layout),
                       Requirement(("args", 1), values, layout.moved(layout.axis - (dim < layout.axis)))])


@rule(aten.cat.default)
def _cat(node, layout, rows):
    tensors = arg(node, "tensors")
    dim = norm_dim(arg(node, "dim"), len(shape_of(node)))
    if dim == layout.axis:
        return "cat along the token dim"
    out_shape = shape_of(node)
    result = RuleResult()
    for j, t in enumerate(tensors):
        shape = shape_of(t)
        if len(shape) != len(out_shape):  # legacy empty tensor in cat
            return "cat of tensors of different ranks"
        result.requirements.append(Requirement(("args", 0, j), t, layout))
    return result


def _reduction(node, layout, rows, dims, keepdim):
    src = arg(node, "self")
    rank = len(shape_of(src))
    dims = list(range(rank)) if dims is None or dims == [] else [norm_dim(d, rank) for d in dims]
    kept = list(range(rank)) if keepdim else [i for i in range(rank) if i not in dims]
    axis = kept[layout.axis]
    if axis in dims:
        return "a reduction over the token dim"
    reason = symint_uses_rows(node, rows)
    if reason:
        return reason
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis))])


@rule(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.prod.dim_int)
def _reduce_dims(node, layout, rows):
    dims = arg(node, "dim")
    if isinstance(dims, int):
        dims = [dims]
    return _reduction(node, layout, rows, dims, arg(node, "keepdim"))


@rule(aten.max.dim, aten.min.dim)
def _max_dim(node, layout, rows):
    """(values, indices) over one dim, reached through getitem."""
    return _reduction(node, layout, rows, [arg(node, "dim")], arg(node, "keepdim"))


@rule(aten.var.correction, aten.var_mean.correction)
def _var(node, layout, rows):
    return _reduction(node, layout, rows, arg(node, "dim"), arg(node, "keepdim"))


@rule(aten._softmax.default, aten._log_softmax.default)
def _softmax(node, layout, rows):
    src, dim = arg(node, "self"), arg(node, "dim")
    if norm_dim(dim, len(shape_of(src))) == layout.axis:
        return "softmax over the token dim"
    return RuleResult([Requirement(("args", 0), src, layout)])


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.native_layer_norm.default)
def _multi_output(node, layout, rows):
    if node.target is not aten.native_layer_norm.default:
        src = arg(node, "self")
        if norm_dim(arg(node, "dim"), len(shape_of(src))) == layout.axis:
            return "split along the token dim"
        return RuleResult([Requirement(("args", 0), src, layout)])
    result = RuleResult([Requirement(("args", 0), arg(node, "input"), layout)])
    for name in ("weight", "bias"):
        if isinstance(arg(node, name), Node):
            result.requirements.append(Requirement(("args", arg_position(node.target, name)), arg(node, name), None))
    return result


@rule(operator.getitem)
def _getitem(node, layout, rows):
    return RuleResult([Requirement(("args", 0), node.args[0], layout)])
