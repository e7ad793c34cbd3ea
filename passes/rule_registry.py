"""The hoisting rules' types and registry: what a rule answers, how it is registered and found.

A rule answers: to compute ``node[rows]`` (rows selected on ``layout``), which rows of which inputs
are needed? Each tensor input is either row-aligned (gathered on a layout of its own) or needed
whole (weights, broadcast operands, attention K/V). An op without a rule stops the hoist. The rules
themselves are in ``hoist_rules.py`` (elementwise ops, products, views, reductions),
``index_rules.py`` (lookups, gathers, scatters, top-k), ``attention_rules.py`` and
``collective_rules.py``; ``sorted_dispatch.py`` is a block rule. Importing ``hoist_rules``
registers them all.

Invariants:
- A rule returns a :class:`RuleResult`, or a string: the reason the hoist stops at the node.
- Rules only describe; the rewrite (passes/cut_graph.py) applies ``arg_rewrites`` (sizes in the
  reduced row count, sizes of the full graph given as sympy expressions, the sdpa op's
  ``query_suffix`` flag) and ``set_query_rows`` to nodes that join the reduced region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
from torch.fx import Node

from .token_layout import Layout, depends_on, same_size, shape_exprs

aten = torch.ops.aten
prims = torch.ops.prims

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


def shape_of(node: Node) -> list[sympy.Expr]:
    return shape_exprs(node.meta.get("val")) or []


def norm_dim(dim: int, rank: int) -> int:
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


def is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def symint_uses_rows(node: Node, rows: sympy.Symbol) -> str | None:
    for path, arg in tensor_args(node):
        if not is_tensor(arg) and depends_on(arg, rows):
            return f"argument {path[1:]} is a size computed from the token count"
    return None


def broadcast_requirement(path, arg: Node, out_shape, layout: Layout) -> Requirement | str:
    """Elementwise operand: aligned from the right, row-aligned or broadcast (needed whole)."""
    shape = shape_of(arg)
    axis = layout.axis - (len(out_shape) - len(shape))
    if axis < 0 or (shape[axis] == 1 and out_shape[layout.axis] != 1):
        return Requirement(path, arg, None)
    if not same_size(shape[axis], out_shape[layout.axis]):
        return f"operand {path[1:]} has {shape[axis]} rows on the token dim, output has {out_shape[layout.axis]}"
    return Requirement(path, arg, layout.moved(axis))


# Ops that are elementwise but carry no pointwise tag.
EXTRA_ELEMENTWISE = {
    prims.convert_element_type.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.copy.default, aten.where.self,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.empty_like.default, aten.fill.Scalar, aten.clamp.default,
}

POINTWISE = "pointwise"  # the key of the elementwise rule: ops with the pointwise tag, or in EXTRA_ELEMENTWISE


def lookup_rule(node: Node) -> RuleFn | None:
    target = node.target
    if target in RULES:
        return RULES[target]
    if isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or target in EXTRA_ELEMENTWISE
    ):
        return RULES.get(POINTWISE)
    return None
