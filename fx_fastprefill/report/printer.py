"""A canonical text picture of a cut graph, for golden tests and for reading.

Stable across runs: nodes are numbered in graph order per region, inputs carry their module-path
names, sizes print as T (tokens), R (logits rows) or s0, s1... in order of appearance; no
addresses, file paths or pass-internal names.
"""

from __future__ import annotations

import sympy
import torch
from torch.fx import Node

from fx_fastprefill.passes.fx_utils import op_name, size_names
from fx_fastprefill.passes.split_regions import BOUNDARY, FULL, REDUCED, assign_regions

DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int64: "i64",
          torch.int32: "i32", torch.bool: "b8", torch.float64: "f64"}


def format_size(size, symbols: dict) -> str:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        for sym in sorted(expr.free_symbols, key=str):
            if sym not in symbols:
                symbols[sym] = f"s{sum(1 for v in symbols.values() if v.startswith('s'))}"
        return str(expr.subs({s: sympy.Symbol(n) for s, n in symbols.items()})).replace(" ", "")
    return str(int(size))


def format_shape(val, symbols: dict) -> str:
    if isinstance(val, torch.Tensor):
        return f"{DTYPES.get(val.dtype, str(val.dtype))}[{', '.join(format_size(s, symbols) for s in val.shape)}]"
    if isinstance(val, torch.SymInt):
        return format_size(val, symbols)
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(format_shape(v, symbols) for v in val) + ")"
    return type(val).__name__


def print_cut_graph(report) -> str:
    """The report's graph, region by region."""
    gm = report.graph
    if gm is None:
        return "(no graph: this report's program was loaded from the AOTAutograd cache; clear the cache to print it)"
    symbols = size_names(report.rows_symbol, report.reduced_rows_symbol)
    regions = assign_regions(gm) if report.cut else {}
    names: dict[Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            names[node] = (f"size_{format_size(val, symbols)}" if isinstance(val, torch.SymInt)
                           else report.placeholder_names.get(node, node.name))
        elif node.op == "get_attr":
            names[node] = f"const{sum(1 for n in names.values() if n.startswith('const'))}"

    def arg_text(arg) -> str:
        if isinstance(arg, Node):
            return f"%{names[arg]}"
        if isinstance(arg, (list, tuple)):
            return "[" + ", ".join(arg_text(a) for a in arg) + "]"
        if isinstance(arg, torch.dtype):
            return DTYPES.get(arg, str(arg))
        if isinstance(arg, float):
            return repr(round(arg, 6))
        if isinstance(arg, torch.device):
            return "device"
        return repr(arg)

    sections = {FULL: [], BOUNDARY: [], REDUCED: []} if report.cut else {"graph (not cut)": []}
    counters = {k: 0 for k in sections}
    prefix = {FULL: "f", BOUNDARY: "g", REDUCED: "r", "graph (not cut)": "v"}
    inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if (
                isinstance(val, torch.Tensor)
                and val.dim() >= 1
                and not any(isinstance(s, torch.SymInt) for s in val.shape)
            ):
                continue  # weights: named where used
            inputs.append(f"  %{names[node]}: {format_shape(val, symbols)}")
            continue
        if node.op != "call_function":
            continue
        section = regions.get(node, "graph (not cut)")
        names[node] = f"{prefix[section]}{counters[section]}"
        counters[section] += 1
        args = ", ".join([arg_text(a) for a in node.args] + [f"{k}={arg_text(v)}" for k, v in node.kwargs.items()])
        sections[section].append(
            f"  %{names[node]} = {op_name(node.target)}({args}) : {format_shape(node.meta.get('val'), symbols)}"
        )
    output = next(n for n in gm.graph.nodes if n.op == "output")
    lines = ["inputs:"] + inputs
    titles = {FULL: "full region (all T rows):", BOUNDARY: "boundary (gather rows by logits_indices):",
              REDUCED: "reduced region (R rows):", "graph (not cut)": "graph (not cut):"}
    for key, body in sections.items():
        lines.append(titles[key])
        lines.extend(body)
    lines.append(f"return {arg_text(output.args[0])}")
    return "\n".join(lines)
