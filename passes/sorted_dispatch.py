"""Hoisting rule for a sort-based dispatch as a block: transformers' ``grouped_mm`` MoE experts.

Such a dispatch flattens each row's ``(row, expert)`` pairs, sorts them by expert id, gathers the
inputs in that order (``hidden[perm // k]``, ``weights[perm]``), runs the experts on contiguous
groups (``grouped_mm`` with offsets from a histogram of the sorted ids) and puts the pairs back in
their order with the inverse permutation::

    ids_sorted, perm = sort(ids)
    inv = index_put(empty_like(perm), [perm], arange(n))
    y = f(a[perm], b[perm // k], ..., ids_sorted)[inv]

Op by op nothing here is row-wise (the sort mixes rows), but the block is: ``y[p] = f(a[p],
b[p // k], ..., ids[p])``, because ``f`` works pair by pair in the sorted order, each pair's expert
being its sorted id. So ``y``'s rows need only the same rows of ``ids`` and of the gathered inputs,
and the whole block can run again on those rows alone. This rule proves the pattern and returns
every node of the block as joining the region; anything in between that is not pair-wise makes it
a stop that names the op.

Invariants:
- Matched only from ``x[inv]`` where ``inv`` inverts the permutation of a 1-D ``sort``; every block
  node's users are in the block or are ``x[inv]`` itself (nothing else sees the sorted order).
- In the sorted order, a node is pair-wise when its ordinary hoisting rule proves it row-wise on
  dim 0 with the pairs' layout, or it is a grouped matmul whose offsets are the cumulative
  histogram of the sorted ids.
- The block's inputs are requirements of the block nodes that read them (``Requirement.user``):
  a boundary gather replaces that node's argument, not one of ``y``'s.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch.fx import Node

from .fx_utils import arg, arg_position
from .rule_registry import REDUCED_SIZE, Requirement, RuleResult
from .token_layout import Layout, is_factor, size_expr

aten = torch.ops.aten
prims = torch.ops.prims

GROUPED_MM = "grouped_mm"  # aten._grouped_mm, transformers::grouped_mm_fallback: (x, weights, offsets)


def _is_grouped_mm(node: Node) -> bool:
    return node.op == "call_function" and GROUPED_MM in str(node.target)


def _call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def inverse_permutation(y: Node) -> tuple[Node, Node, Node] | None:
    """(x, inv, sort) when ``y`` is ``x[inv]`` with ``inv = index_put(empty(n), [perm], arange(n))``
    and ``perm`` the permutation of a 1-D sort (``empty_like`` / ``arange`` as written, or as
    Inductor's decompositions spell them: ``empty.memory_format``, ``prims.iota``)."""
    x, indices = arg(y, "self"), arg(y, "indices")
    if len(indices) != 1 or not _call(indices[0], aten.index_put.default):
        return None
    inv = indices[0]
    target, where, values = arg(inv, "self"), arg(inv, "indices"), arg(inv, "values")
    if arg(inv, "accumulate") or len(where) != 1:
        return None
    perm = where[0]
    if not (_call(perm, operator.getitem) and perm.args[1] == 1 and _count_path(target, perm) is not None
            and _count_path(values, perm) is not None):
        return None
    sort = perm.args[0]
    if not _call(sort, aten.sort.default, aten.sort.stable) or arg(sort, "self").meta["val"].dim() != 1:
        return None
    return x, inv, sort


def _count_path(node: Node, perm: Node) -> tuple | None:
    """Where ``node`` (an empty tensor or ``0 .. n - 1`` of ``perm``'s length) holds its length:
    the argument path the cut rewrites in the reduced rows; () for ``empty_like(perm)``."""
    if _call(node, aten.empty_like.default) and arg(node, "self") is perm:
        return ()
    if _call(node, aten.empty.memory_format) and len(arg(node, "size")) == 1:
        return ("args", 0, 0)
    if _call(node, aten.arange.default) and len(node.args) == 1:
        return ("args", 0)
    if _call(node, aten.arange.start_step) and (arg(node, "start"), arg(node, "step")) == (0, 1) or \
            _call(node, aten.arange.start) and arg(node, "start") == 0:
        return ("args", arg_position(node.target, "end"))
    if _call(node, prims.iota.default) and node.kwargs.get("start") == 0 and node.kwargs.get("step") == 1:
        return ("args", 0)
    return None


def _offsets_of_sorted_ids(offsets: Node, sort: Node) -> list[Node] | None:
    """The nodes of ``cumsum(histc(cast(ids_sorted)))``, when ``offsets`` is that."""
    chain, node = [], offsets
    for targets in ((aten.cumsum.default,), (aten.histc.default,)):
        if not _call(node, *targets):
            return None
        chain.append(node)
        node = node.args[0]
    while _call(node, prims.convert_element_type.default, aten._to_copy.default):
        chain.append(node)
        node = node.args[0]
    if not (_call(node, operator.getitem) and node.args[0] is sort and node.args[1] == 0):
        return None
    return chain + [node]


def sorted_dispatch(y: Node, layout: Layout, rows, lookup_rule):
    """The block rule for ``y = x[inv]`` (see the module docstring): a RuleResult whose ``absorbed``
    nodes join the region with ``y``, a stop reason, or None when ``y`` is not such a block."""

    found = inverse_permutation(y)
    if found is None:
        return None
    x, inv, sort = found
    if layout.axis != 0:
        return "the experts' sorted dispatch with rows off its pair dim"
    perm = arg(inv, "indices")[0]
    block: dict[Node, object] = {inv: RuleResult(), sort: RuleResult(), perm: RuleResult()}
    for counted in (arg(inv, "self"), arg(inv, "values")):  # the empty tensor and arange(n): n in the reduced rows
        rewrites = _pair_count_rewrite(counted, _count_path(counted, perm), rows)
        if rewrites is None:
            return "the experts' sorted dispatch: its pair count is not a multiple of the row count"
        block[counted] = RuleResult(arg_rewrites=rewrites)
    result = RuleResult([Requirement(("args", 0), arg(sort, "self"), layout, sort)])
    stack = [x]
    while stack:
        node = stack.pop()
        if node in block:
            continue
        if _call(node, operator.getitem) and node.args[0] is sort:
            block[node] = RuleResult()
            continue
        if _call(node, aten.index.Tensor) and len(arg(node, "indices")) == 1:
            source, index = arg(node, "self"), arg(node, "indices")[0]
            gathered = _gathered_layout(index, perm, layout)
            if gathered is not None:  # an input put in sorted order: the block reads its rows
                block[node] = RuleResult()
                if index is not perm:
                    block[index] = RuleResult()
                result.requirements.append(Requirement(("args", 0), source, gathered, node))
                continue
        if _is_grouped_mm(node):
            chain = _offsets_of_sorted_ids(node.args[2], sort)
            if chain is None:
                return f"the experts' sorted dispatch: {node.target}'s offsets are not the sorted ids' histogram"
            block[node] = RuleResult()
            block.update((c, RuleResult()) for c in chain)
            result.requirements.append(Requirement(("args", 1), node.args[1], None, node))
            stack.append(node.args[0])
            continue
        fn = lookup_rule(node) if node.op == "call_function" else None
        pair_wise = fn(node, layout, rows) if fn is not None else f"no hoisting rule for {node.target}"
        if isinstance(pair_wise, str):
            return f"the experts' sorted dispatch: {pair_wise} ({node.name})"
        block[node] = pair_wise
        for req in pair_wise.requirements:
            if req.layout is None:
                result.requirements.append(Requirement(req.path, req.node, None, node))
            elif req.layout != layout:  # a view that regroups the pairs: no longer one pair per row
                return f"the experts' sorted dispatch: {node.name} ({node.target}) regroups the pairs"
            else:
                stack.append(req.node)
    members = set(block) | {y}
    for node in block:
        outside = [u for u in node.users if u not in members]
        if outside:
            return f"the experts' sorted dispatch: {node.name} is also read by {outside[0].name}"
    result.absorbed = block
    return result


def _gathered_layout(index: Node, perm: Node, layout: Layout) -> Layout | None:
    """The rows of a tensor gathered by ``perm`` (pair order: ``layout``) or by ``perm // c`` (row
    order: ``c`` pairs per row, ``c`` dividing the layout's blocks)."""
    if index is perm:
        return layout
    if _call(index, aten.floor_divide.default, aten.div.Tensor_mode) and arg(index, "self") is perm:
        c = arg(index, "other")
        if index.target is aten.div.Tensor_mode and arg(index, "rounding_mode") != "floor":
            return None
        if isinstance(c, int) and c > 0 and (layout.inner % c) == 0:
            return Layout(0, layout.inner / c, layout.outer)
    return None


def _pair_count_rewrite(node: Node, path: tuple, rows) -> dict | None:
    """The pair count at ``path`` of ``node``, re-expressed in the reduced rows by the cut; it must
    be the row count times a factor free of it (an int, or sizes such as the batch)."""
    if path == ():
        return {}
    size = node.args[path[1]] if len(path) == 2 else node.args[path[1]][path[2]]
    value = size.meta.get("val") if isinstance(size, Node) else size
    factor = sympy.simplify(size_expr(value) / rows) if isinstance(value, (int, torch.SymInt)) else None
    return {path: REDUCED_SIZE} if factor is not None and is_factor(factor, rows) else None
