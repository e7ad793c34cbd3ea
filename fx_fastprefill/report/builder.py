"""Turns what the passes found into the user's words: module paths, source lines, plain reasons.

The passes speak in aten nodes (``mm_48``); a user knows ``layers.5.attn`` and the line of their
model that made the node. Everything the report shows about a node goes through here.
"""

from __future__ import annotations

import re

from torch.fx import GraphModule, Node

from fx_fastprefill.ops.schema import ATTENTION_OP, K, KV_SOURCE, LAYER, V, WRITE_KV_OP
from fx_fastprefill.passes.attention_nodes import AttentionNode
from fx_fastprefill.passes.fx_utils import innermost_module, size_names
from fx_fastprefill.passes.fx_utils import op_name as target_name
from fx_fastprefill.passes.meta_keys import SOURCE
from fx_fastprefill.passes.pipeline import HOIST_STOPPED

from .printer import format_shape
from .report import AttentionLayerInfo, FastPrefillReport, GatheredTensor, HoistStop, NarrowedTensor


def source_line(node: Node) -> str:
    """The innermost user frame of a node's stack trace: 'file:line in fn: code'."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return ""
    path, line, fn, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line} in {fn}: {code.strip()}"


def op_name(node: Node) -> str:
    return "graph input" if node.op == "placeholder" else target_name(node.target)


def describe(node: Node, report: FastPrefillReport) -> str:
    if node.op == "placeholder":
        return report.placeholder_names.get(node, node.name)
    path = innermost_module(node)
    return f"{path}:{node.name}" if path else node.name


def kv_consumers(gm: GraphModule, attention: list[AttentionNode]) -> dict[Node, list[str]]:
    """For every node, the layers whose own K/V (the values written to the KV cache) it feeds
    (``attention``: the attention nodes the hoisting plan found in ``gm``)."""
    feeds: dict[Node, list[str]] = {}
    dataflow_owners = {a.node: a for a in attention if a.keys is not None and not a.shares_kv}
    for node in gm.graph.nodes:
        is_write = node.op == "call_function" and node.target is WRITE_KV_OP
        owns_kv = node.op == "call_function" and node.target is ATTENTION_OP and node.args[KV_SOURCE] is None
        if is_write or owns_kv:
            layer = node.args[2] if is_write else node.args[LAYER]
            stack = [a for a in (node.args[0], node.args[1]) if isinstance(a, Node)] if is_write else \
                [a for a in (node.args[K], node.args[V]) if isinstance(a, Node)]
        elif node in dataflow_owners:  # sdpa or eager attention: K/V are its arguments
            owner = dataflow_owners[node]
            layer, stack = owner.layer, [owner.keys, owner.values]
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
        where = source_line(blocker) or "no source line"
        reason = f"needed for all rows by {describe(blocker, report)} ({op_name(blocker)}, {where})"
    return HoistStop(describe(node, report), op_name(node), reason, source_line(node),
                     describe(blocker, report) if blocker is not None else "", kv_layers)


def unreduced_reasons(attention, layers: set[str], stops, report: FastPrefillReport) -> dict[str, str]:
    """Why each of ``layers`` (eligible, not reduced) runs on every row: the last place the hoist
    stopped downstream of the layer's attention, where its output is needed for all rows."""
    order = {node: i for i, node in enumerate(report.graph.graph.nodes)} if report.graph is not None else {}
    reasons = {}
    for attn in attention:
        if attn.layer not in layers:
            continue
        downstream, stack = set(), [attn.node]
        while stack:
            node = stack.pop()
            for user in node.users:
                if user not in downstream:
                    downstream.add(user)
                    stack.append(user)
        found = [s for s in stops if s.node in downstream]
        if found:
            last = max(found, key=lambda s: order.get(s.node, 0))
            stop = hoist_stop(last, report, {})
            reasons[attn.layer] = f"its output reaches {stop.tensor} ({stop.op}), {stop.reason}"
        else:
            reasons[attn.layer] = "its output is needed for all rows"
    return reasons


def gathered(node: Node, report: FastPrefillReport) -> GatheredTensor:
    source = node.meta[SOURCE]
    symbols = size_names(report.rows_symbol, report.reduced_rows_symbol)
    shape = f"{format_shape(source.meta['val'], symbols)} -> {format_shape(node.meta['val'], symbols)}"
    return GatheredTensor(describe(source, report), shape, source_line(source))


def narrowed_tensor(split, report: FastPrefillReport) -> NarrowedTensor:
    """A tensor split by passes/narrow_sliced_producers.py (``split`` is its ``Narrowed``)."""
    node = split.tensor
    return NarrowedTensor(
        describe(node, report),
        format_shape(node.meta["val"], size_names(report.rows_symbol, report.reduced_rows_symbol)),
        split.dim,
        list(split.full),
        list(split.reduced),
        source_line(node),
    )


def build_report(ctx, input_names: dict, cudagraphs: bool, fallbacks) -> FastPrefillReport:
    """The report of one compiled graph, from the pipeline's context (``ctx``: a PassContext)."""
    graph = ctx.gm if not ctx.declined else (ctx.unchanged or ctx.gm)
    names = dict(input_names)
    names.update({ctx.copies[node]: name for node, name in input_names.items() if node in ctx.copies})
    report = FastPrefillReport(
        cut=not ctx.declined,
        reason=ctx.declined,
        attention_layers=[AttentionLayerInfo(a.layer, a.kv_source, a.sliding_window, a.masked) for a in ctx.layers],
        eligible_layers=list(ctx.eligible),
        draft_layers=[a.layer for a in ctx.layers if a.layer in ctx.options.draft_layers],
        prompt_len=ctx.options.prompt_len,
        fallbacks=fallbacks,
        cudagraphs=cudagraphs,
        pass_seconds=dict(ctx.seconds),
        graph=graph,
        placeholder_names={n: names.get(n, n.name) for n in graph.graph.nodes if n.op == "placeholder"},
    )
    plan = ctx.plan
    if plan is None:
        return report
    report.rows_symbol, report.reduced_rows_symbol = plan.rows, plan.reduced_rows
    if plan.rows.is_number:  # static shapes: the graph's own prompt length (passes/flops.py)
        report.prompt_len = int(plan.rows)
    report.placeholder_names.update({n: names.get(n, n.name) for n in ctx.gm.graph.nodes if n.op == "placeholder"})
    feeds_kv = kv_consumers(ctx.gm, plan.attention_nodes)
    report.stops = [hoist_stop(stop, report, feeds_kv) for stop in plan.stops]
    report.flops_full = ctx.flops_full
    if ctx.declined == HOIST_STOPPED and report.stops:
        first = report.stops[0]
        hint = (
            " (hidden states or attentions asked for as outputs keep every row)"
            if first.reason == "a graph output"
            else ""
        )
        report.reason = f"{HOIST_STOPPED}: {first.tensor} ({first.op}): {first.reason}{hint}"
    if ctx.declined:
        return report
    reduced_attention = set(plan.reduced_attention)
    if plan.suffix is None:
        index = report.placeholder_names.get(plan.index, plan.index.name)
        report.row_selection = "rows by logits_indices" if plan.per_step else \
            f"the same rows of each sequence, given by the index tensor {index} (logits_to_keep)"
    elif isinstance(plan.suffix, int):
        report.row_selection = f"the last {plan.suffix} row{'s' if plan.suffix > 1 else ''} of each sequence " \
            "(logits_to_keep)"
    else:
        report.row_selection = "the last k rows of each sequence (logits_to_keep, k given at run time)"
    attention = plan.attention_nodes
    report.reduced_layers = [a.layer for a in attention if a.node in reduced_attention]
    report.unreduced = unreduced_reasons(attention, set(ctx.eligible) - set(report.reduced_layers), plan.stops, report)
    report.gathered = [gathered(node, report) for node in ctx.gm.graph.nodes if SOURCE in node.meta]
    report.narrowed = [narrowed_tensor(split, report) for split in ctx.narrowed]
    report.flops_cut = ctx.flops_cut
    report.flops_removed_fraction = 1.0 - ctx.flops_cut / ctx.flops_full if ctx.flops_full else 0.0
    return report
