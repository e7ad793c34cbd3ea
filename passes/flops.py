"""Estimated prefill FLOPs of a graph for one prompt of a stated length.

Counts matrix products (mm, addmm, bmm: ``torch.utils.flop_counter``'s formulas) and attention;
elementwise work is ignored. Attention is counted here, not by ``flop_counter``: its SDPA formula
counts every query against every key (no causal mask, no window), and it has none for the
package's own attention op, whose rows and window this count reads from the graph. A causal
attention call over all rows sees sum(min(p + 1, window)) keys; in its query-subset form each of
its R queries (the last rows of the prompt) sees min(L, window) keys. An sdpa call (transformers
models) keeps its window in the mask, so it is counted as causal over all keys.

Invariants: reads only; evaluates sizes with T = prompt length, R = 1, any other symbol = 1.
"""

from __future__ import annotations

import sympy
import torch
from torch.fx import GraphModule
from torch.utils import flop_counter

from fx_fastprefill.ops.schema import ATTENTION_OP, Q, QUERY_ROWS, SDPA_OP, SDPA_Q, SDPA_QUERY_SUFFIX, SLIDING_WINDOW

from .token_layout import shape_exprs

aten = torch.ops.aten
# A matrix product's FLOPs from its operands' shapes, as torch's FLOP counter computes them.
_MATMUL_FLOPS = {aten.mm.default: flop_counter.mm_flop, aten.addmm.default: flop_counter.addmm_flop,
                 aten.bmm.default: flop_counter.bmm_flop}


def _evaluate(expr: sympy.Expr, values: dict) -> int:
    expr = expr.subs(values)
    return int(expr.subs({s: 1 for s in expr.free_symbols}))


def estimate_flops(gm: GraphModule, rows: sympy.Expr, reduced_rows: sympy.Expr, prompt_len: int) -> float:
    if rows.is_number:  # a static graph's prompt length is its own
        prompt_len = int(rows)
    values = {rows: prompt_len} if isinstance(rows, sympy.Symbol) else {}
    if isinstance(reduced_rows, sympy.Symbol):
        values[reduced_rows] = 1  # a static suffix is already a number
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _MATMUL_FLOPS:
            operands = [a for a in node.args if isinstance(a, torch.fx.Node)]  # (bias,) a, b
            shapes = [[_evaluate(e, values) for e in shape_exprs(a.meta["val"])] for a in operands]
            total += _MATMUL_FLOPS[node.target](*shapes)
        elif node.target is ATTENTION_OP:
            q = [_evaluate(e, values) for e in shape_exprs(node.args[Q].meta["val"])]
            window = node.args[SLIDING_WINDOW] or prompt_len
            if node.args[QUERY_ROWS] is None:
                keys = sum(min(p + 1, window) for p in range(prompt_len))
            else:
                keys = q[0] * min(prompt_len, window)
            total += 4 * q[1] * q[2] * keys
        elif node.target is SDPA_OP:
            # [B, H, Lq, D]; the window, if any, lives in the mask: counted as causal over all keys.
            q = [_evaluate(e, values) for e in shape_exprs(node.args[SDPA_Q].meta["val"])]
            batch_heads = 1
            for size in q[:-2]:
                batch_heads *= size
            keys = q[-2] * prompt_len if node.args[SDPA_QUERY_SUFFIX] else prompt_len * (prompt_len + 1) // 2
            total += 4 * batch_heads * q[-1] * keys
    return float(total)
