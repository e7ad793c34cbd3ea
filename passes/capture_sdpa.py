"""Replace ``F.scaled_dot_product_attention`` calls in a Dynamo graph by ``fx_fastprefill::sdpa``.

Runs on the graph Dynamo hands the backend, before AOT tracing turns each call into a
backend-specific aten op. The new op names its layer: the qualified name of the innermost module
on the call's ``nn_module_stack`` (``model.layers.7.self_attn``), as the user sees it in
``model.named_modules()``.

Invariants:
- Only SDPA calls change, and only their target and argument spelling: the computation is the
  same (``query_suffix=False`` keeps SDPA's own semantics exactly).
- Layer names are unique: a module that calls SDPA twice gets ``name#1``, ``name#2``.
- A graph without SDPA calls is left untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from fx_fastprefill.ops.schema import SDPA_LAYER, SDPA_OP

from .fx_utils import module_path

SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _layer_name(node: Node, index: int) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return f"sdpa_{index}"
    key, _ = list(stack.values())[-1]
    return module_path(key) or f"sdpa_{index}"


def capture_sdpa(gm: GraphModule) -> list[str]:
    """Rewrite in place; returns the layer names in graph order."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    names = [_layer_name(n, i) for i, n in enumerate(calls)]
    repeated = {name for name in names if names.count(name) > 1}
    seen: dict[str, int] = {}
    for node, name in zip(calls, names):
        if name in repeated:
            seen[name] = seen.get(name, 0) + 1
            name = f"{name}#{seen[name]}"
        bound = dict(zip(_PARAMETERS, node.args))
        bound.update(node.kwargs)
        values = [bound[p] if p in bound else _DEFAULTS[p] for p in _PARAMETERS]
        node.target = SDPA_OP
        node.args = (*values, name, False)
        node.kwargs = {}
    if calls:
        gm.recompile()
    return [n.args[SDPA_LAYER] for n in calls]
