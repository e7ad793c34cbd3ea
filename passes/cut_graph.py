"""Apply a hoisting plan: gather the boundary tensors, run the region on the gathered rows.

Invariants:
- One gather per (boundary tensor, layout), placed just before its first reader, reading the
  ``logits_indices`` graph input; each one is tagged ``meta["ffp_role"] = "boundary_gather"``.
- Region nodes keep their identity and ops; only their inputs, token-dim sizes (-1, inferred) and,
  for attention, ``query_rows`` (the query-subset form) change.
- The model's own gathers disappear: their users read the reduced value directly.
- Every node downstream of a gather gets fresh fake values (sizes in the reduced row count).
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from fx_fastprefill.attention_op import QUERY_ROWS

from .gather_hoisting import HoistPlan
from .hoist_rules import REDUCED_SIZE
from .token_layout import Layout

aten = torch.ops.aten

BOUNDARY_GATHER = "boundary_gather"
REDUCED_SIZE_NODE = "reduced_size"  # sizes computed from logits_indices belong to the reduced region


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


class _ReducedSizes:
    """Size arguments re-expressed in R: ``T * c`` becomes ``sym_size(logits_indices, 0) * c``,
    computed once, the way the traced graph itself spells sizes."""

    def __init__(self, gm: GraphModule, plan: HoistPlan):
        self.gm, self.plan = gm, plan
        self.nodes: dict = {}

    def _node_for(self, factor, before: Node) -> Node:
        graph = self.gm.graph
        if factor not in self.nodes:
            with graph.inserting_after(self.plan.index):
                rows = self.nodes.get(1) or graph.call_function(torch.ops.aten.sym_size.int, (self.plan.index, 0))
                rows.meta["val"] = self.plan.index.meta["val"].shape[0]
                rows.meta["ffp_role"] = REDUCED_SIZE_NODE
                self.nodes[1] = rows
            if factor != 1:
                with graph.inserting_after(rows):
                    scaled = graph.call_function(operator.mul, (rows, int(factor)))
                scaled.meta["val"] = rows.meta["val"] * int(factor)
                scaled.meta["ffp_role"] = REDUCED_SIZE_NODE
                self.nodes[factor] = scaled
        return self.nodes[factor]

    def __call__(self, node: Node, size) -> Node | int:
        val = size.meta["val"] if isinstance(size, Node) else size
        expr = val.node.expr if isinstance(val, torch.SymInt) else None
        factor = sympy.simplify(expr / self.plan.rows) if expr is not None else None
        if factor is None or not factor.is_Integer:
            return -1  # inferred from the other sizes
        return self._node_for(int(factor), node)


def _insert_gather(gm: GraphModule, source: Node, layout: Layout, index: Node, before: Node) -> Node:
    graph = gm.graph
    with graph.inserting_before(before):
        if layout.inner == 1:
            gathered = graph.call_function(aten.index_select.default, (source, layout.axis, index))
        else:
            shape = list(source.meta["val"].shape)
            if not isinstance(layout.inner, int) and not layout.inner.is_Integer:
                raise CutError(f"{source.name}: rows merged with a dynamic dim cannot be gathered")
            if any(isinstance(s, torch.SymInt) for i, s in enumerate(shape) if i != layout.axis):
                raise CutError(f"{source.name}: rows merged with other dims of a dynamic tensor cannot be gathered")
            inner = int(layout.inner)
            split = shape[: layout.axis] + [-1, inner] + shape[layout.axis + 1:]
            merged = shape[: layout.axis] + [-1] + shape[layout.axis + 1:]
            blocks = graph.call_function(aten.reshape.default, (source, split))
            picked = graph.call_function(aten.index_select.default, (blocks, layout.axis, index))
            gathered = graph.call_function(aten.reshape.default, (picked, merged))
            blocks.meta["ffp_role"] = picked.meta["ffp_role"] = BOUNDARY_GATHER
    gathered.meta["ffp_role"] = BOUNDARY_GATHER
    gathered.meta["ffp_source"] = source
    gathered.meta["ffp_layout"] = layout
    return gathered


def cut_graph(gm: GraphModule, plan: HoistPlan) -> list[Node]:
    """Rewrite ``gm`` in place; returns the boundary gather nodes."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = []
    for (source, layout), users in plan.boundary.items():
        first_user = min((u for u, _ in users), key=order.__getitem__)
        gathered = _insert_gather(gm, source, layout, plan.index, first_user)
        gathers.append(gathered)
        for user, path in users:
            if user.op == "call_function" and any(user is s for s, _ in plan.seeds):
                continue  # the model's own gather: replaced below
            _set_arg(user, path, gathered)
    reduced_size = _ReducedSizes(gm, plan)
    for node, result in plan.rules.items():
        for path, value in result.size_rewrites.items():
            if value == REDUCED_SIZE:
                value = reduced_size(node, _get_arg(node, path))
            _set_arg(node, path, value)
        if result.set_query_rows:
            _set_arg(node, ("args", QUERY_ROWS), plan.index)
    for seed, layout in plan.seeds:
        source = seed.args[0]
        replacement = source if source in plan.region else next(
            g for g in gathers if g.meta["ffp_source"] is source and g.meta["ffp_layout"] == layout
        )
        seed.replace_all_uses_with(replacement)
        gm.graph.erase_node(seed)
    gm.graph.lint()
    gm.recompile()
    refresh_fake_values(gm, gathers)
    return gathers


def downstream(nodes: list[Node]) -> set[Node]:
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(u for u in node.users if u.op != "output")
    return seen


def refresh_fake_values(gm: GraphModule, changed: list[Node]) -> None:
    """Recompute ``meta["val"]`` of every node downstream of ``changed``, in graph order."""
    placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(placeholders)
    dirty = downstream(changed)

    def value(arg):
        return arg.meta["val"] if isinstance(arg, Node) else arg

    with fake_mode:
        for node in gm.graph.nodes:
            if node not in dirty or node.op != "call_function":
                continue
            args = torch.fx.node.map_aggregate(node.args, value)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
            node.meta["val"] = node.target(*args, **kwargs)
            node.meta.pop("tensor_meta", None)  # stale sizes; Inductor's passes read it when present
