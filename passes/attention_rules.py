"""Hoisting rules of the attention ops: the flat convention's ``attention`` (its queries' rows,
K/V and the cache write's token whole; the rewrite sets ``query_rows``) and ``sdpa`` (queries on
their dim -2, K/V whole, a mask gathered on its query dim; the rewrite runs it on a suffix of the
queries). Registered on import (``rule_registry.py``).
"""

from __future__ import annotations

from torch.fx import Node

from fx_fastprefill.ops.schema import (ATTENTION_OP, K, KV_WRITTEN, Q, QUERY_ROWS, SDPA_IS_CAUSAL, SDPA_K, SDPA_MASK,
                                       SDPA_OP, SDPA_Q, SDPA_QUERY_SUFFIX, SDPA_V, V)

from .rule_registry import Requirement, RuleResult, rule, shape_of
from .token_layout import Layout, same_size


@rule(ATTENTION_OP)
def _attention(node, layout, rows):
    if layout.axis != 0 or not layout.plain:
        return "attention output rows merged with another dim"
    if node.args[QUERY_ROWS] is not None:
        return "attention already runs on a subset of its queries"
    if node.args[KV_WRITTEN] is None:
        return "attention that writes its own cache (run passes/link_kv_sources.py first)"
    result = RuleResult([Requirement(("args", Q), node.args[Q], layout)], set_query_rows=True)
    for i in (K, V, KV_WRITTEN):
        result.requirements.append(Requirement(("args", i), node.args[i], None))
    return result


@rule(SDPA_OP)
def _sdpa(node, layout, rows):
    """Queries are row-aligned on their dim -2; K/V are needed whole; a mask is gathered on its
    query dim unless it broadcasts there. The rewritten call runs on a suffix of the queries."""
    out_shape = shape_of(node)
    if layout.axis != len(out_shape) - 2 or not layout.plain:
        return "attention output rows not on its query dim"
    if node.args[SDPA_QUERY_SUFFIX]:
        return "attention already runs on a subset of its queries"
    q, k, v, mask = (node.args[i] for i in (SDPA_Q, SDPA_K, SDPA_V, SDPA_MASK))
    rewrites = {("args", SDPA_QUERY_SUFFIX): True}
    if node.args[SDPA_IS_CAUSAL] and not same_size(shape_of(q)[-2], shape_of(k)[-2]):
        # Top-left causal over more keys than queries (a static cache's slots): the suffix call is
        # told the full call's query count, and aligns its queries as their last rows.
        # (A keyword: the aten trace drops the trailing default, and Inductor matches positions.)
        rewrites[("kwargs", "causal_queries")] = shape_of(q)[-2]
    result = RuleResult([Requirement(("args", SDPA_Q), q, layout), Requirement(("args", SDPA_K), k, None),
                         Requirement(("args", SDPA_V), v, None)], rewrites)
    if isinstance(mask, Node):
        mask_shape = shape_of(mask)
        if len(mask_shape) < 2 or mask_shape[-2] == 1:
            result.requirements.append(Requirement(("args", SDPA_MASK), mask, None))
        elif same_size(mask_shape[-2], out_shape[layout.axis]):
            result.requirements.append(Requirement(("args", SDPA_MASK), mask, Layout(len(mask_shape) - 2)))
        else:
            return f"attention mask of shape {mask_shape} does not match the queries"
    return result
