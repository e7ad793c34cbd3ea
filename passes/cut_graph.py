"""Apply a hoisting plan: gather the boundary tensors, run the region on the gathered rows.

Invariants:
- One gather per (boundary tensor, layout), placed just before its first reader: an
  ``aten.index`` by the ``logits_indices`` graph input, or for a suffix selection a slice of the
  last ``k`` rows; each one (and the sizes it needs) is tagged ``meta[ROLE] = BOUNDARY_GATHER`` (meta_keys.py).
- Region nodes keep their identity and ops; only their inputs, token-dim sizes (-1, inferred) and,
  for attention, ``query_rows`` (the query-subset form) change.
- The model's own gathers disappear: their users read the reduced value directly.
- Every node downstream of a gather gets fresh fake values (sizes in the reduced row count).
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch.fx import GraphModule, Node

from fx_fastprefill.ops.schema import QUERY_ROWS

from .fx_utils import placeholders, size_sources
from .fake_values import refresh_fake_values
from .gather_hoisting import HoistPlan
from .meta_keys import BOUNDARY_GATHER, FULL_SIZE_NODE, LAYOUT, REDUCED_SIZE_NODE, ROLE, SOURCE
from .rule_registry import REDUCED_SIZE
from .token_layout import Layout, is_factor, shape_exprs

aten = torch.ops.aten



class CutError(Exception):
    """The plan cannot be applied; the graph must be left as it was."""


def _set_arg(node: Node, path: tuple, value) -> None:
    kind, *where = path
    if kind == "kwargs":
        kwargs = dict(node.kwargs)
        kwargs[where[0]] = value
        node.kwargs = kwargs
        return
    args = list(node.args)
    if len(where) == 1:
        args[where[0]] = value
    else:
        inner = list(args[where[0]])
        inner[where[1]] = value
        args[where[0]] = inner
    node.args = tuple(args)


def _get_arg(node: Node, path: tuple):
    kind, *where = path
    if kind == "kwargs":
        return node.kwargs[where[0]]
    value = node.args[where[0]]
    return value if len(where) == 1 else value[where[1]]


class _SizeNodes:
    """Sizes as graph values: integers stay ints, symbols are read off a graph input
    (``sym_size``), products and sums become ``operator`` nodes; each tagged with ``role``."""

    def __init__(self, gm: GraphModule):
        self.gm = gm
        inputs = placeholders(gm)
        self.sources = {symbol: (inputs[i], dim) for symbol, (i, dim) in size_sources(inputs).items()}

    def __call__(self, expr: sympy.Expr, before: Node, role: str):
        expr = sympy.expand(expr)
        if expr.is_Integer:
            return int(expr)
        graph = self.gm.graph
        with graph.inserting_before(before):
            if expr.is_Symbol:
                if expr not in self.sources:
                    raise CutError(f"size {expr} is not the size of any graph input")
                node, dim = self.sources[expr]
                if dim is None:
                    return node
                out = graph.call_function(aten.sym_size.int, (node, dim))
                out.meta["val"] = node.meta["val"].shape[dim]
            elif expr.is_Mul or expr.is_Add:
                fn = operator.mul if expr.is_Mul else operator.add
                terms = [self(t, before, role) for t in expr.args]
                out = terms[0]
                for term in terms[1:]:
                    with graph.inserting_before(before):
                        out = graph.call_function(fn, (out, term))
                    value = [t.meta["val"] if isinstance(t, Node) else t for t in out.args]
                    out.meta["val"] = fn(*value)
                    out.meta[ROLE] = role
                return out
            else:
                raise CutError(f"size {expr} cannot be computed in the graph")
        out.meta[ROLE] = role
        return out


class _ReducedSizes:
    """Size arguments re-expressed in R: ``T * c`` becomes ``R * c``, where R is
    ``sym_size(logits_indices, 0)`` (computed once, the way the traced graph spells sizes) or the
    ``k`` of a suffix selection; other sizes on the token dim are inferred (-1)."""

    def __init__(self, gm: GraphModule, plan: HoistPlan, sizes: _SizeNodes):
        self.gm, self.plan, self.sizes = gm, plan, sizes
        self.nodes: dict = {}

    def _node_for(self, factor, before: Node) -> Node | int:
        if self.plan.index is None:
            return self.sizes(self.plan.reduced_rows * factor, before, REDUCED_SIZE_NODE)
        graph = self.gm.graph
        if factor not in self.nodes:
            with graph.inserting_after(self.plan.index):
                rows = self.nodes.get(1) or graph.call_function(torch.ops.aten.sym_size.int, (self.plan.index, 0))
                rows.meta["val"] = self.plan.index.meta["val"].shape[0]
                rows.meta[ROLE] = REDUCED_SIZE_NODE
                self.nodes[1] = rows
            if factor != 1:
                with graph.inserting_after(rows):
                    scaled = graph.call_function(operator.mul, (rows, int(factor)))
                scaled.meta["val"] = rows.meta["val"] * int(factor)
                scaled.meta[ROLE] = REDUCED_SIZE_NODE
                self.nodes[factor] = scaled
        return self.nodes[factor]

    def __call__(self, node: Node, size) -> Node | int:
        val = size.meta["val"] if isinstance(size, Node) else size
        static = isinstance(val, int) and self.plan.rows.is_number  # static shapes: outer * T * inner
        expr = val.node.expr if isinstance(val, torch.SymInt) else sympy.Integer(val) if static else None
        factor = sympy.simplify(expr / self.plan.rows) if expr is not None else None
        if factor is not None and not factor.is_Integer and is_factor(factor, self.plan.rows):
            # T times other sizes (B * T * k pairs): spelled from the graph's own sizes.
            return self.sizes(self.plan.reduced_rows * factor, node, REDUCED_SIZE_NODE)
        if factor is None or not factor.is_Integer:
            return -1  # inferred from the other sizes
        return self._node_for(int(factor), node)


def _insert_gather(gm: GraphModule, plan: HoistPlan, source: Node, layout: Layout, before: Node,
                   sizes: _SizeNodes) -> Node:
    graph = gm.graph
    shape = shape_exprs(source.meta["val"])
    axis = layout.axis
    if not layout.plain:
        # [..., outer * rows * inner, ...] -> [..., outer, rows, inner, ...]: rows on their own dim
        # (without the outer dim when there is none).
        pre = [sizes(e, before, BOUNDARY_GATHER) for e in shape[:axis]]
        post = [sizes(e, before, BOUNDARY_GATHER) for e in shape[axis + 1:]]
        inner = sizes(layout.inner, before, BOUNDARY_GATHER)
        if layout.outer == 1:
            split = pre + [-1, inner] + post
        else:
            split = pre + [-1, sizes(plan.rows, before, BOUNDARY_GATHER), inner] + post
        merged = pre + [-1] + post
        with graph.inserting_before(before):
            blocks = graph.call_function(aten.reshape.default, (source, split))
        blocks.meta[ROLE] = BOUNDARY_GATHER
        source_view, axis = blocks, axis + (layout.outer != 1)
    else:
        source_view = source
    with graph.inserting_before(before):
        if plan.suffix is None:
            # aten.index, not index_select: the post-decomposition form, which Inductor lowers
            # (index_select is decomposed into it before the cut ever sees the graph).
            picked = graph.call_function(aten.index.Tensor, (source_view, [None] * axis + [plan.index]))
        else:
            start = -plan.suffix if isinstance(plan.suffix, int) else None
            if start is None:  # a symbolic k: -k computed here (the model's own comes after the boundary)
                start = graph.call_function(operator.neg, (plan.suffix,))
                start.meta["val"] = -plan.suffix.meta["val"]
                start.meta[ROLE] = BOUNDARY_GATHER
            picked = graph.call_function(aten.slice.Tensor, (source_view, axis, start, 2**63 - 1))
            if axis > 0:
                # The last k rows of each of B sequences are not contiguous; the region's views
                # (``[B, k, H] -> [B * k, H]``) were traced on contiguous tensors.
                picked.meta[ROLE] = BOUNDARY_GATHER
                picked = graph.call_function(aten.clone.default, (picked,), {"memory_format": torch.contiguous_format})
        gathered = picked
        if not layout.plain:
            picked.meta[ROLE] = BOUNDARY_GATHER
            gathered = graph.call_function(aten.reshape.default, (picked, merged))
    gathered.meta[ROLE] = BOUNDARY_GATHER
    gathered.meta[SOURCE] = source
    gathered.meta[LAYOUT] = layout
    return gathered


def _spell_sizes_of_region_nodes(gm: GraphModule, plan: HoistPlan, sizes: _SizeNodes) -> None:
    """A size read off a tensor that now holds reduced rows (``sym_size``, left outside the region:
    gather_hoisting.reads_size) is the full graph's size: spelled from the graph's inputs instead."""
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is aten.sym_size.int and node.args[0] in plan.region):
            continue
        val = node.meta["val"]
        value = sizes(val.node.expr if isinstance(val, torch.SymInt) else sympy.Integer(val), node, FULL_SIZE_NODE)
        for user in list(node.users):
            user.args = torch.fx.node.map_aggregate(user.args, lambda a: value if a is node else a)
            user.kwargs = torch.fx.node.map_aggregate(user.kwargs, lambda a: value if a is node else a)
        gm.graph.erase_node(node)


def cut_graph(gm: GraphModule, plan: HoistPlan) -> list[Node]:
    """Rewrite ``gm`` in place; returns the boundary gather nodes."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sizes = _SizeNodes(gm)
    gathers = []
    for (source, layout), users in plan.boundary.items():
        first_user = min((u for u, _ in users), key=order.__getitem__)
        gathered = _insert_gather(gm, plan, source, layout, first_user, sizes)
        gathers.append(gathered)
        for user, path in users:
            if user.op == "call_function" and any(user is s for s, _ in plan.seeds):
                continue  # the model's own gather: replaced below
            _set_arg(user, path, gathered)
    reduced_size = _ReducedSizes(gm, plan, sizes)
    for node, result in plan.rules.items():
        for path, value in result.arg_rewrites.items():
            if isinstance(value, sympy.Expr):  # a size of the full graph, spelled from its inputs
                value = sizes(value, node, FULL_SIZE_NODE)
            elif value == REDUCED_SIZE:
                value = reduced_size(node, _get_arg(node, path))
            _set_arg(node, path, value)
        if result.set_query_rows:
            _set_arg(node, ("args", QUERY_ROWS), plan.index)
    _spell_sizes_of_region_nodes(gm, plan, sizes)
    for seed, layout in plan.seeds:
        source = seed.args[0]
        replacement = source if source in plan.region else next(
            g for g in gathers if g.meta[SOURCE] is source and g.meta[LAYOUT] == layout
        )
        seed.replace_all_uses_with(replacement)
        gm.graph.erase_node(seed)
    gm.graph.lint()
    gm.recompile()
    new_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta]
    # Nodes whose sizes were rewritten, with no gathered input (an empty tensor, an arange of R * k).
    resized = [node for node, result in plan.rules.items() if result.arg_rewrites]
    refresh_fake_values(gm, gathers + new_nodes + resized)
    return gathers
