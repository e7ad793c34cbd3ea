"""Gather-hoisting analysis: how far upstream the logits-row gather can move.

Starting from the model's own row selection, walk the graph backwards in
reverse topological order. A node joins the reduced region when every user of it is already in the
region (or is the gather) and asks for its rows on one and the same layout, and its op has a
transfer rule (passes/hoist_rules.py). Where a node cannot join, the hoist stops there: if region
users need its rows, it becomes a boundary tensor, gathered once per layout.

The row selection is one of:
- a gather by a graph input, ``hidden[logits_indices]`` (flat convention): any rows, chosen per
  step (``plan.per_step``: the graph's attention ops read the step's metadata, and the reduced
  region runs behind the step gate); or ``hidden[:, index]`` in a transformers graph
  (``logits_to_keep`` given as a 1-D tensor): the same rows of every sequence, no gate;
- a slice of the last ``k`` rows of every sequence, ``hidden[:, -k:]`` (transformers'
  ``logits_to_keep``): ``plan.suffix = k``.
An ``sdpa`` node with ``is_causal`` joins the region for a suffix only: its query-subset form aligns
the causal mask bottom-right. With an explicit mask (gathered on its query dim) any rows are exact.

Invariants:
- Sound by construction: a region node's every user is in the region (or reads only its size, which
  the cut spells from the graph's inputs), so nothing outside the region ever sees reduced rows;
  anything needed whole (attention K/V, which feed the KV cache, broadcast operands, graph outputs)
  stays in the full region.
- Conservative: an op without a rule, or a rule that cannot prove row alignment, stops the hoist.
- Boundary tensors are tensors: where a multi-output node (a split, a fused QKV chunk) stops the
  hoist, its getitems leave the region and are gathered instead.
- Reads only; the rewrite is passes/cut_graph.py.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

import sympy
import torch
from torch.fx import GraphModule, Node

from fx_fastprefill.ops.schema import ATTENTION_OP, SDPA_IS_CAUSAL, SDPA_OP

from .attention_nodes import AttentionNode, find_attention_nodes
from .fx_utils import downstream, is_open_end, slice_args
from .hoist_rules import RuleResult, lookup_rule
from .token_layout import Layout, shape_exprs

aten = torch.ops.aten


@dataclass
class Stop:
    """A tensor the hoist could not move past, and why."""
    node: Node
    layout: Layout
    reason: str
    blocker: Node | None = None  # the node that needs it with all rows, where there is one


@dataclass
class HoistPlan:
    rows: sympy.Expr              # token count T (per sequence, for a suffix selection): a symbol,
    #                               or an integer when the graph was traced with static shapes
    reduced_rows: sympy.Expr      # logits-row count R: a symbol, or k of a constant suffix
    index: Node | None            # the logits_indices graph input (None for a suffix selection)
    seeds: list[tuple[Node, Layout]]  # the model's own gathers and the layout they select on
    suffix: int | Node | None = None  # k of a suffix selection: a constant, or the graph's SymInt k
    per_step: bool = False  # an index chosen per step (flat convention): the reduced region is gated
    region: dict[Node, Layout] = field(default_factory=dict)
    rules: dict[Node, RuleResult] = field(default_factory=dict)
    # (tensor, layout) -> the (user, argument path) pairs that read its gathered rows
    boundary: dict[tuple[Node, Layout], list[tuple[Node, tuple]]] = field(default_factory=dict)
    stops: list[Stop] = field(default_factory=list)
    attention: set[Node] = field(default_factory=set)  # every attention node (passes/attention_nodes.py)
    attention_nodes: list[AttentionNode] = field(default_factory=list)  # the same, as found: layer names, K/V

    @property
    def reduced_attention(self) -> list[Node]:
        return [n for n in self.region if n in self.attention]


class NoCut(Exception):
    """The graph has no gather the pass can hoist; the message says why."""


def _row_gather(node: Node) -> tuple[Node, Node, int] | None:
    """(source, index, axis) when ``node`` selects rows of one dim by a 1-D integer index tensor."""
    if node.op != "call_function":
        return None
    if node.target is aten.index.Tensor:
        src, indices = node.args
        picked = [(i, ix) for i, ix in enumerate(indices) if ix is not None]
        if len(picked) != 1:
            return None
        axis, index = picked[0]
    elif node.target is aten.index_select.default:
        src, axis, index = node.args
    else:
        return None
    val = index.meta.get("val") if isinstance(index, Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 1 or val.dtype not in (torch.int32, torch.int64):
        return None
    return src, index, axis


def _single_symbol(expr: sympy.Expr) -> sympy.Symbol | None:
    return expr if isinstance(expr, sympy.Symbol) else None


def _row_count(expr: sympy.Expr, symbolic_only: bool) -> sympy.Expr | None:
    return expr if isinstance(expr, sympy.Symbol) or (expr.is_Integer and not symbolic_only) else None


NO_SELECTION = (
    "no row selection to hoist: neither a gather by a graph input (hidden[logits_indices]) nor a slice of the "
    "last rows (hidden[:, -k:], transformers' logits_to_keep) in this graph. Either logits for all rows were asked "
    "for (logits_to_keep=0, the default of a plain forward), or the step has one token per sequence (decode), or a "
    "graph break left the row selection in another graph (this one returns every row; torch.compile(..., "
    "fullgraph=True) names the break)"
)


def _clamped_suffix(gm: GraphModule) -> str | None:
    """The reason when the graph's row selection is ``x[:, -k:]`` with a k that may exceed the token
    count: it keeps min(k, T) rows, not k, so there is no fixed logits-row count to cut to."""
    for node in gm.graph.nodes:
        found = _last_rows_slice(node)
        if found is not None and found[2] == found[1]:  # Dynamo's guards have k >= T in this graph
            _, rows, _, k, k_expr = found
            name = str(k) if isinstance(k, int) else f"k ({k_expr})"
            return (f"the row selection x[:, -k:] keeps every row in this graph: logits_to_keep={name} is not less "
                    f"than the token count ({rows}), so there are no fewer logits rows to cut to")
    return None


def find_seeds(gm: GraphModule, per_step: bool) -> tuple[list[tuple[Node, Layout]], Node, sympy.Expr, sympy.Expr]:
    """The model's row gathers by a graph input, all by the same index; raises NoCut otherwise.
    Row counts are symbols, or (``per_step`` False: no step gate to find them by) integers of a
    graph traced with static shapes."""
    candidates = []
    for node in gm.graph.nodes:
        found = _row_gather(node)
        if found is None:
            continue
        src, index, axis = found
        if index.op != "placeholder":
            continue
        shape = shape_exprs(src.meta.get("val"))
        rows = _row_count(shape[axis], per_step) if shape else None
        reduced = _row_count(shape_exprs(index.meta["val"])[0], per_step)
        if rows is None or reduced is None:
            continue
        candidates.append((node, index, axis, rows, reduced))
    if not candidates:
        raise NoCut(NO_SELECTION)
    index = candidates[-1][1]
    chosen = [c for c in candidates if c[1] is index]
    rows, reduced = chosen[0][3], chosen[0][4]
    if rows == reduced and rows.is_Integer:
        raise NoCut(f"the index selects {reduced} rows of {rows}: as many as the tokens, nothing to cut")
    if rows == reduced:
        raise NoCut(
            "the token count and the logits-row count share one size symbol (they were equal when traced, and duck "
            "shaping merged them): trace through fx_fastprefill.Runner, or with "
            "torch.fx.experimental._config.use_duck_shape=False"
        )
    if any(c[3] != rows for c in chosen):
        raise NoCut("the model gathers rows of tensors with different token counts by the same index")
    return [(c[0], Layout(c[2])) for c in chosen], index, rows, reduced


def _last_rows_slice(node: Node) -> tuple[int, sympy.Expr, sympy.Expr, int | Node, sympy.Expr] | None:
    """(dim, rows, rows kept, k, k as an expression) when ``node`` is ``x[..., -k:, ...]`` over a dim
    whose size is one symbol, or a constant (static shapes: the dim the slice selects on is the
    token dim, T its size); ``k`` is an int, or the graph input holding a symbolic k (an int
    ``logits_to_keep`` Dynamo made dynamic)."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return None
    shape, out = shape_exprs(node.args[0].meta.get("val")), shape_exprs(node.meta.get("val"))
    if not shape or not out:
        return None
    dim, start, end, step = slice_args(node)
    dim = dim + len(shape) if dim < 0 else dim
    if step not in (None, 1) or not is_open_end(end):
        return None
    rows = shape[dim] if shape[dim].is_Integer else _single_symbol(shape[dim])
    if rows is None:
        return None
    if isinstance(start, int):
        return (dim, rows, out[dim], -start, sympy.Integer(-start)) if start < 0 else None
    if isinstance(start, Node) and start.target is operator.neg and isinstance(start.args[0], Node) \
            and start.args[0].op == "placeholder":
        k_val = start.args[0].meta.get("val")
        if isinstance(k_val, torch.SymInt) and isinstance(k_val.node.expr, sympy.Symbol):
            return dim, rows, out[dim], start.args[0], k_val.node.expr
    return None


def _suffix_slice(node: Node) -> tuple[Layout, sympy.Expr, int | Node, sympy.Expr] | None:
    """(layout, rows, k, reduced rows) when ``node`` takes the last k rows of a dim
    (:func:`_last_rows_slice`) and the graph knows k < T: the slice's size is k itself. With k > T
    possible it keeps min(k, T) rows; with k == T, every row (nothing to cut). Dynamo specializes a
    symbolic k of 0 and 1 (their own graphs: -0 is every row), so such a graph runs for k >= 2."""
    found = _last_rows_slice(node)
    if found is None:
        return None
    dim, rows, kept, k, k_expr = found
    if kept != k_expr or k_expr == rows:
        return None
    return Layout(dim), rows, k, k_expr


def find_suffix_seed(gm: GraphModule) -> tuple[Node, Layout, sympy.Expr, int | Node, sympy.Expr] | None:
    """The last slice of the last k rows (transformers' logits_to_keep): over a dim of one size
    symbol, or, in a graph traced with static shapes, over a dim of more than k rows."""
    found = None
    for node in gm.graph.nodes:
        suffix = _suffix_slice(node)
        if suffix is not None:
            found = (node, *suffix)
    return found


def reads_size(node: Node) -> bool:
    """``node`` reads a size of its input, not its values: it needs no row of it (passes/cut_graph.py
    spells the size from the graph's inputs where the input now lives in the reduced region only)."""
    return node.op == "call_function" and node.target is aten.sym_size.int


def _output_nodes(gm: GraphModule) -> set[Node]:
    return set(next(n for n in reversed(gm.graph.nodes) if n.op == "output").all_input_nodes)


def _check_outputs(gm: GraphModule, seeds: set[Node], reduced: sympy.Symbol, outputs: set[Node]) -> None:
    """Every graph output computed from the gathered rows must hold them on one plain dim, so that
    the full-rows path can select them at the end."""
    for node in downstream(seeds) & outputs:
        shape = shape_exprs(node.meta.get("val"))
        plain = [s for s in shape or [] if reduced in s.free_symbols]
        if len(plain) != 1 or plain[0] != reduced:
            raise NoCut(f"graph output {node.name} is computed from the logits rows but does not keep them on one dim")


def _leave_region(plan: HoistPlan, node: Node, requests: dict[Layout, list], reason: str, blocker: Node | None) -> None:
    """Take ``node`` out of the region again: it becomes a boundary tensor, gathered for the region
    nodes that requested it, and a stop with ``reason`` (its producer's)."""
    del plan.region[node]
    del plan.rules[node]
    for layout, users in requests.items():
        plan.boundary[(node, layout)] = users
        plan.stops.append(Stop(node, layout, reason, blocker))


def analyze(gm: GraphModule) -> HoistPlan:
    per_step = any(n.op == "call_function" and n.target is ATTENTION_OP for n in gm.graph.nodes)
    try:
        seeds, index, rows, reduced = find_seeds(gm, per_step)
        plan = HoistPlan(rows, reduced, index, seeds, per_step=per_step)
    except NoCut:
        found = find_suffix_seed(gm)
        if found is None:
            clamped = _clamped_suffix(gm)
            if clamped:
                raise NoCut(clamped) from None
            raise
        seed, layout, rows, count, reduced = found
        plan = HoistPlan(rows, reduced, None, [(seed, layout)], suffix=count)
    plan.attention_nodes = find_attention_nodes(gm.graph)
    plan.attention = {a.node for a in plan.attention_nodes}
    requested: dict[Node, dict[Layout, list]] = defaultdict(lambda: defaultdict(list))
    needed_whole: dict[Node, tuple[str, Node]] = {}
    seed_nodes = {s for s, _ in plan.seeds}
    outputs = _output_nodes(gm)
    for seed, layout in plan.seeds:
        requested[seed.args[0]][layout].append((seed, ("args", 0)))
    if plan.per_step:  # the gate's full-rows path selects the logits rows of the outputs
        _check_outputs(gm, seed_nodes, reduced, outputs)

    for node in reversed(list(gm.graph.nodes)):
        if node not in requested or node in seed_nodes:
            continue
        layouts = requested[node]
        reason, blocker = None, None
        outside = [u for u in node.users if u not in plan.region and u not in seed_nodes and not reads_size(u)]
        if node.op != "call_function":
            reason = "a graph input"
        elif node in outputs:
            reason = "a graph output"
        elif node in needed_whole:
            reason, blocker = needed_whole[node]
        elif outside:
            reason, blocker = f"also needed for all rows by {outside[0].name} ({outside[0].target})", outside[0]
        elif len(layouts) > 1:
            reason = "needed with rows on two different dims"
        elif node.target is SDPA_OP and plan.suffix is None and node.args[SDPA_IS_CAUSAL]:
            reason = ("causal sdpa attention (is_causal, no mask) whose queries are chosen by an index: its causal "
                      "mask stays aligned only for a suffix")
        else:
            fn = lookup_rule(node)
            layout = next(iter(layouts))
            result = fn(node, layout, rows) if fn is not None else f"no hoisting rule for {node.target}"
            if isinstance(result, str):
                reason = result
        if reason is not None:
            if isinstance(node.meta.get("val"), (list, tuple)):
                # A multi-output node (split, chunk, unbind, a norm's tuple): no tensor to gather.
                # The boundary moves down to the outputs the region reads, its getitems.
                for users in layouts.values():
                    for user, _ in users:
                        _leave_region(plan, user, requested[user], reason, blocker)
                continue
            for layout, users in layouts.items():
                plan.boundary[(node, layout)] = users
                plan.stops.append(Stop(node, layout, reason, blocker))
            continue
        plan.region[node] = layout
        plan.rules[node] = result
        for member, member_result in result.absorbed.items():  # a block rule's other nodes
            plan.region[member] = layout
            plan.rules[member] = member_result
        for req in result.requirements:
            user = req.user or node
            if req.layout is None:
                needed_whole.setdefault(req.node, (f"needed whole by {user.name} ({user.target})", user))
            else:
                requested[req.node][req.layout].append((user, req.path))
    return plan
