"""Hoisting rules of ops that look values up or place them by index: embeddings, ``index`` (and
the sorted MoE dispatch it may open, ``sorted_dispatch.py``), ``gather`` and ``scatter`` off the
token dim (routers), top-k and sort within a row. Registered on import (``rule_registry.py``).

Invariant: an index tensor is row-aligned with its output's rows, or needed whole; never mixed.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from .fx_utils import arg, arg_position
from .rule_registry import Requirement, RuleResult, lookup_rule, norm_dim, rule, shape_of
from .sorted_dispatch import sorted_dispatch
from .token_layout import same_size

aten = torch.ops.aten


@rule(aten.embedding.default)
def _embedding(node, layout, rows):
    weight, indices = arg(node, "weight"), arg(node, "indices")
    if layout.axis >= len(shape_of(indices)):
        return "embedding with rows on the feature dim"
    return RuleResult([Requirement(("args", 0), weight, None), Requirement(("args", 1), indices, layout)])


@rule(aten.index_select.default)
def _index_select(node, layout, rows):
    src, dim, index = node.args
    if norm_dim(dim, len(shape_of(src))) == layout.axis:
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
    width = len(shape_of(index))
    if d <= layout.axis < d + width:
        return RuleResult([Requirement(("args", 0), src, None),
                           Requirement(("args", 1, d), index, layout.moved(layout.axis - d))])
    axis = layout.axis if layout.axis < d else layout.axis - width + 1
    return RuleResult([Requirement(("args", 0), src, layout.moved(axis)), Requirement(("args", 1, d), index, None)])


@rule(aten.gather.default)
def _gather(node, layout, rows):
    """``out[..i..][j] = src[..i..][index[..i..][j]]`` along another dim than the token dim (a router
    picking its experts' scores per row): the output's rows are the source's and the index's."""
    src, dim, index = arg(node, "self"), arg(node, "dim"), arg(node, "index")
    rank = len(shape_of(src))
    if norm_dim(dim, rank) == layout.axis:
        return "gather along the token dim"
    if not same_size(shape_of(src)[layout.axis], shape_of(node)[layout.axis]):
        return "gather of fewer rows than its source"
    return RuleResult([Requirement(("args", 0), src, layout), Requirement(("args", 2), index, layout)])


@rule(aten.scatter.value, aten.scatter.src, aten.scatter_add.default, aten.scatter_reduce.two)
def _scatter(node, layout, rows):
    """``out = self; out[..i..][index[..i..][j]] = src[..i..][j]`` along another dim than the token
    dim (a router's mask of chosen experts or groups): row-aligned, every operand on the same rows."""
    if norm_dim(arg(node, "dim"), len(shape_of(node))) == layout.axis:
        return "scatter along the token dim"
    result = RuleResult()
    names = {a.name for a in node.target._schema.arguments}
    for name in [n for n in ("self", "index", "src", "value") if n in names]:
        operand = arg(node, name)
        if not isinstance(operand, Node):
            continue
        if not same_size(shape_of(operand)[layout.axis], shape_of(node)[layout.axis]):
            return f"scatter whose operand {name} has other rows than its output"
        result.requirements.append(Requirement(("args", arg_position(node.target, name)), operand, layout))
    return result


@rule(aten.topk.default, aten.sort.default, aten.sort.stable)
def _along_one_dim(node, layout, rows):
    """top-k or sort within each row (a router's top-k experts): row-wise unless along the token dim."""
    src = arg(node, "self")
    if norm_dim(arg(node, "dim"), len(shape_of(src))) == layout.axis:
        return f"{node.target} along the token dim"
    return RuleResult([Requirement(("args", 0), src, layout)])
