"""Turns what the passes found into the user's words: module paths, source lines, plain reasons.

The passes speak in aten nodes (``mm_48``); a user knows ``layers.5.attn`` and the line of their
model that made the node. Everything the report shows about a node goes through here.
"""

from __future__ import annotations

import re

import sympy

from torch.fx import GraphModule, Node

from fx_fastprefill.attention_op import ATTENTION_OP, K, KV_SOURCE, LAYER, V, WRITE_KV_OP
from fx_fastprefill.passes.attention_nodes import find_attention_nodes
from fx_fastprefill.sdpa_op import SDPA_K, SDPA_LAYER, SDPA_OP, SDPA_V

from .report import FastPrefillReport, GatheredTensor, HoistStop, NarrowedTensor


def clean_name(name: str) -> str:
    """Dynamo's placeholder names as module paths: L_self_modules_embed_parameters_weight_ -> embed.weight."""
    name = re.sub(r"^[lL]_(self_)?", "", name).rstrip("_")
    name = re.sub(r"_(modules|parameters|buffers)_", ".", "_" + name).lstrip("_").lstrip(".")
    name = re.sub(r"^(modules|parameters|buffers)_", "", name)
    return name


def source_line(node: Node) -> str:
    """The innermost user frame of a node's stack trace: 'file:line in fn: code'."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return ""
    path, line, fn, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line} in {fn}: {code.strip()}"


def module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return clean_name(path.replace("L['self'].", "").replace("L__self___", "")) if path else ""


def op_name(node: Node) -> str:
    target = node.target
    if node.op == "placeholder":
        return "graph input"
    schema = getattr(target, "_schema", None)
    if schema is not None:
        overload = target._overloadname
        return schema.name.replace("::", ".") + ("" if overload == "default" else f".{overload}")
    return str(target)


def describe(node: Node, report: FastPrefillReport) -> str:
    if node.op == "placeholder":
        return report.placeholder_names.get(node, node.name)
    path = module_path(node)
    return f"{path}:{node.name}" if path else node.name


def kv_consumers(gm: GraphModule) -> dict[Node, list[str]]:
    """For every node, the layers whose own K/V (the values written to the KV cache) it feeds."""
    feeds: dict[Node, list[str]] = {}
    sdpa_owners = {a.node for a in find_attention_nodes(gm.graph) if a.node.target is SDPA_OP and not a.shares_kv}
    for node in gm.graph.nodes:
        is_write = node.op == "call_function" and node.target is WRITE_KV_OP
        owns_kv = node.op == "call_function" and node.target is ATTENTION_OP and node.args[KV_SOURCE] is None
        if is_write or owns_kv:
            layer = node.args[2] if is_write else node.args[LAYER]
            stack = [a for a in (node.args[0], node.args[1]) if isinstance(a, Node)] if is_write else \
                [a for a in (node.args[K], node.args[V]) if isinstance(a, Node)]
        elif node in sdpa_owners:
            layer, stack = node.args[SDPA_LAYER], [node.args[SDPA_K], node.args[SDPA_V]]
        else:
            continue
        seen: set[Node] = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if layer not in feeds.setdefault(n, []):
                feeds[n].append(layer)
            stack.extend(n.all_input_nodes)
    return feeds


def hoist_stop(stop, report: FastPrefillReport, feeds_kv: dict[Node, list[str]]) -> HoistStop:
    """One place the hoist stopped, with the plainest reason that is true."""
    node, blocker = stop.node, stop.blocker
    reason = stop.reason
    kv_layers = feeds_kv.get(blocker, []) if blocker is not None else []
    if node.op == "placeholder":
        reason = "a graph input: gathered as it comes in"
    elif kv_layers:
        reason = (f"needed for all rows: it feeds the K/V of {', '.join(kv_layers)}, which every later token "
                  f"attends to (through {describe(blocker, report)}, {op_name(blocker)})")
    elif blocker is not None:
        reason = f"needed for all rows by {describe(blocker, report)} ({op_name(blocker)}, {source_line(blocker) or 'no source line'})"
    return HoistStop(describe(node, report), op_name(node), reason, source_line(node),
                     describe(blocker, report) if blocker is not None else "", kv_layers)


def _size_names(report: FastPrefillReport) -> dict:
    symbols = {report.rows_symbol: "T"}
    if isinstance(report.reduced_rows_symbol, sympy.Symbol):  # a static suffix has no symbol
        symbols[report.reduced_rows_symbol] = "R"
    return symbols


def gathered(node: Node, report: FastPrefillReport) -> GatheredTensor:
    from .graph_printer import format_shape
    source = node.meta["ffp_source"]
    symbols = _size_names(report)
    shape = f"{format_shape(source.meta['val'], symbols)} -> {format_shape(node.meta['val'], symbols)}"
    return GatheredTensor(describe(source, report), shape, source_line(source))


def narrowed_tensor(split, report: FastPrefillReport) -> NarrowedTensor:
    """A tensor split by passes/narrow_sliced_producers.py (``split`` is its ``Narrowed``)."""
    from .graph_printer import format_shape
    node = split.tensor
    return NarrowedTensor(describe(node, report), format_shape(node.meta["val"], _size_names(report)), split.dim,
                          list(split.full), list(split.reduced), source_line(node))
