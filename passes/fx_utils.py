"""Small FX helpers shared by the passes, the region executor and the report.

Invariants: reads only; nothing here changes a graph.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import sympy
import torch
from torch.fx import GraphModule, Node

from .token_layout import same_size

# What an open-ended slice (``x[a:]``) traces to as its end.
SLICE_END = 2**62


def slice_args(node: Node) -> tuple[int, object, object, object]:
    """``(dim, start, end, step)`` of an ``aten.slice.Tensor`` call, defaults filled in."""
    return arg(node, "dim"), arg(node, "start"), arg(node, "end"), arg(node, "step")


def arg(node: Node, name: str) -> Any:
    """The argument ``name`` of an op call, read by the op's schema: positional or keyword as the
    call passes it, the schema's default where it leaves it out. ``node.args[i]`` would tie a pass
    to argument positions and miss keywords and defaults."""
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name != name:
            continue
        if not argument.kwarg_only and i < len(node.args):
            return node.args[i]
        if name in node.kwargs:
            return node.kwargs[name]
        if argument.has_default_value():
            return argument.default_value
        raise ValueError(f"{op_name(node.target)} call {node.name} lacks its argument {name!r}")
    raise KeyError(f"{op_name(node.target)} has no argument {name!r}")


def arg_position(target: Any, name: str) -> int:
    """Where the op's schema puts the argument ``name`` (a rewrite's path into ``node.args``)."""
    return next(i for i, a in enumerate(target._schema.arguments) if a.name == name)


def is_open_end(end: object) -> bool:
    """A slice end that means 'to the end' whatever the size (None, or the traced huge int)."""
    return end is None or (isinstance(end, int) and end >= SLICE_END)


def reaches_end(end: object, size: sympy.Expr | None = None) -> bool:
    """Whether a slice end reaches the end of a dim of ``size`` (open ends always do)."""
    if is_open_end(end):
        return True
    if size is None:
        return False
    value = end.meta.get("val") if isinstance(end, Node) else end
    expr = (
        value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(value) if isinstance(value, int) else None
    )
    return expr is not None and same_size(expr, size)


def is_whole_slice(node: Node) -> bool:
    """``x[:, :]``-style: a unit-step slice from 0 to the open end (every index)."""
    _, start, end, step = slice_args(node)
    return start in (None, 0) and step in (None, 1) and is_open_end(end)


def downstream(nodes: Iterable[Node]) -> set[Node]:
    """``nodes`` and every node that reads them, transitively (the output node excluded)."""
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(u for u in node.users if u.op != "output")
    return seen


def size_sources(placeholders: list[Node]) -> dict[sympy.Symbol, tuple[int, int | None]]:
    """Where each plain size symbol can be read at run time: (input position, dim), or
    (position, None) for a SymInt input. The first input that has it wins."""
    sources: dict[sympy.Symbol, tuple[int, int | None]] = {}
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
            sources.setdefault(val.node.expr, (i, None))
        elif isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(size.node.expr, (i, d))
    return sources


def placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def output_args(gm: GraphModule):
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]


def op_name(target: object) -> str:
    """``aten.mm``, ``aten.squeeze.dim``, ``fx_fastprefill.attention``; plain names for Python callables."""
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.replace("::", ".")
        overload = target._overloadname
        return name + ("" if overload == "default" else f".{overload}")
    return getattr(target, "__name__", str(target))


def module_path(stack_key: str) -> str:
    """A Dynamo module path as the user spells it in ``named_modules()``:
    ``L['self'].model.layers[7].self_attn`` -> ``model.layers.7.self_attn``. The root is dropped
    however Dynamo reached the model: ``L['self']``, ``L['args'][0]`` (traced from ``__call__``),
    a global ``G['model']``."""
    name = re.sub(r"\._modules\['([^']+)'\]", r".\1", stack_key)
    name = re.sub(r"^[LG]\['[^']*'\](\[\d+\])*\.?", "", name).replace("L__self___", "")
    name = re.sub(r"\[(\d+)\]", r".\1", name)
    return name.strip(".")


def input_name(placeholder_name: str) -> str:
    """A Dynamo graph input's name as a module path: ``L_self_modules_embed_parameters_weight_`` ->
    ``embed.weight``, ``L_input_ids_`` -> ``input_ids``."""
    name = re.sub(r"^[lL]_(self_)?", "", placeholder_name).rstrip("_")
    name = re.sub(r"_(modules|parameters|buffers)_", ".", "_" + name).lstrip("_").lstrip(".")
    return re.sub(r"^(modules|parameters|buffers)_", "", name)


def innermost_module(node: Node) -> str:
    """The user-facing path of the innermost module a node was traced in ("" when none)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    key = list(stack.values())[-1][0]
    return module_path(key) if key else ""


def size_names(rows: sympy.Expr | None, reduced_rows: sympy.Expr | None) -> dict:
    """The printable names of the row counts: T for the tokens, R for the logits rows (a static
    suffix's R is a number already)."""
    names = {}
    if isinstance(rows, sympy.Symbol):  # a static graph's counts are numbers
        names[rows] = "T"
    if isinstance(reduced_rows, sympy.Symbol):
        names[reduced_rows] = "R"
    return names
