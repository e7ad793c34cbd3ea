"""The attention layers of a graph, in graph order, with their KV-sharing relation.

Three kinds of attention node:
- ``fx_fastprefill::attention`` (flat convention): the relation is the op's own ``layer`` /
  ``kv_source`` arguments.
- ``fx_fastprefill::sdpa`` (transformers models, see passes/capture_sdpa.py): the relation is
  dataflow. A layer shares K/V when its K and V arguments, followed back through views, expands
  and copies (each layer's own GQA repeat), are the same tensors as an earlier layer's; its source
  is the first layer that used them. A layer also shares when its K and V do not depend on the
  previous attention layer's output (made from an earlier layer's latent with weights of its own).
- eager attention (``attn_implementation="eager"``), recognised by its pattern: ``bmm(Q, K^T)``
  (or ``baddbmm(bias, Q, K^T)``: BLOOM's ALiBi bias added in the product), then elementwise ops
  (scale, softcap, mask) and views, a softmax over the keys (decomposed or not), then
  ``bmm(P, V)``. Attention sinks are part of the pattern (gpt-oss: a logit per head joined to the
  scores along the keys before the softmax, its probability sliced off after). The node is the
  second ``bmm``; the relation is dataflow, as for sdpa. Nothing is rewritten: the hoist passes
  the pattern with its generic rules (queries' rows, keys and values whole, the mask gathered on
  its query dim), exact for any row selection.

Invariants: reads only.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fx_fastprefill.ops.schema import (ATTENTION_OP, KV_SOURCE, LAYER, SDPA_K, SDPA_LAYER, SDPA_MASK, SDPA_OP, SDPA_V,
                                       SLIDING_WINDOW)

from .fx_utils import arg, innermost_module, is_whole_slice

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that present the same K/V values under another shape or layout.
SAME_VALUES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.clone.default, aten.alias.default,
    aten.permute.default, aten.transpose.int, aten.slice.Tensor, aten.contiguous.default,
}


@dataclass
class AttentionNode:
    node: Node
    layer: str
    kv_source: str | None
    sliding_window: int | None
    masked: bool = False  # sdpa or eager with the model's own mask (its window, if any, lives in the mask)
    keys: Node | None = None  # K and V as the call reads them (dataflow kinds: sdpa, eager)
    values: Node | None = None

    @property
    def shares_kv(self) -> bool:
        return self.kv_source is not None


def kv_root(node: Node) -> Node:
    """The tensor a K/V argument presents, past views, expands and copies."""
    while node.op == "call_function" and node.target in SAME_VALUES:
        if node.target is aten.slice.Tensor and not is_whole_slice(node):
            break
        node = node.args[0]
    return node


# Eager attention: the views and casts between its two bmms, and the softmax (whole or decomposed).
_SCORE_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                aten.clone.default, prims.convert_element_type.default, aten._to_copy.default}
_KEY_DIM_OPS = {aten._softmax.default, aten.amax.default, aten.max.dim, aten.sum.dim_IntList, aten.slice.Tensor,
                aten.cat.default}


def _is_pointwise(node: Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _tensor_operands(node: Node) -> list[Node]:
    return [a for a in node.args if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _along_last_dim(node: Node) -> bool:
    """A softmax or one of its decomposed reductions (amax, max, sum with keepdim) over the last
    dim (the keys), or a slice or a cat along it (attention sinks: a per-head logit joined to the
    scores before the softmax, its probability dropped after)."""
    if node.target not in _KEY_DIM_OPS:
        return False
    first = arg(node, "tensors")[0] if node.target is aten.cat.default else arg(node, "self")
    rank = first.meta["val"].dim()
    dims = arg(node, "dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return len(dims) == 1 and dims[0] in (-1, rank - 1)


def _score_operands(node: Node) -> list[Node]:
    if node.target is aten.cat.default:
        return [a for a in arg(node, "tensors") if isinstance(a, Node)]
    if node.target is operator.getitem:  # values of a max over the keys
        return [node.args[0]] if node.args[1] == 0 and node.args[0].target is aten.max.dim else []
    return _tensor_operands(node)


def _eager_attention(out: Node, limit: int = 256) -> tuple[Node, bool] | None:
    """(scores bmm, masked) when ``out`` is the ``bmm(P, V)`` of an eager attention call: ``P`` is
    computed from one ``bmm`` through views, pointwise ops (scale, softcap, mask, and the softmax
    as Inductor's decompositions spell it) and reductions over the last dim, with an ``exp`` or a
    softmax among them. ``masked``: another tensor of two or more dims enters the scores (a mask)."""
    stack, seen, scores = [arg(out, "self")], set(), set()
    softmax = masked = False
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > limit:
            return None
        if node.op == "call_function" and node.target in (aten.bmm.default, aten.baddbmm.default):
            scores.add(node)  # baddbmm: a bias added to the scores (BLOOM's ALiBi)
            masked = masked or node.target is aten.baddbmm.default
        elif node.op == "call_function" and (node.target in _SCORE_VIEWS or _is_pointwise(node)
                                             or node.target is operator.getitem or _along_last_dim(node)):
            softmax = softmax or node.target in (aten.exp.default, aten._softmax.default)
            operands = _score_operands(node)
            if not operands and node.target is operator.getitem:
                return None
            stack.extend(operands)
        else:
            masked = masked or node.meta["val"].dim() >= 2
    if len(scores) != 1 or not softmax:
        return None
    return next(iter(scores)), masked


def find_attention_nodes(graph: Graph) -> list[AttentionNode]:
    found = []
    owners: dict[tuple[Node, Node], str] = {}
    eager_names: dict[str, int] = {}

    def dataflow(node: Node, layer: str, keys: Node, values: Node, masked: bool) -> AttentionNode:
        roots = (kv_root(keys), kv_root(values))
        source = owners.setdefault(roots, layer)
        return AttentionNode(node, layer, None if source == layer else source, None, masked, keys, values)

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is ATTENTION_OP:
            found.append(AttentionNode(node, node.args[LAYER], node.args[KV_SOURCE], node.args[SLIDING_WINDOW]))
        elif node.target is SDPA_OP:
            found.append(dataflow(node, node.args[SDPA_LAYER], node.args[SDPA_K], node.args[SDPA_V],
                                  node.args[SDPA_MASK] is not None))
        elif node.target is aten.bmm.default:
            eager = _eager_attention(node)
            if eager is None:
                continue
            scores, masked = eager
            layer = innermost_module(node) or "eager_attention"
            eager_names[layer] = eager_names.get(layer, 0) + 1
            if eager_names[layer] > 1:
                layer = f"{layer}#{eager_names[layer]}"
            keys = arg(scores, "batch2") if scores.target is aten.baddbmm.default else arg(scores, "mat2")
            found.append(dataflow(node, layer, keys, arg(node, "mat2"), masked))
    _sources_computed_earlier(graph, found)
    return found


def _sources_computed_earlier(graph: Graph, found: list[AttentionNode]) -> None:
    """A dataflow layer whose K and V do not depend on the previous attention layer's output reads
    K/V computed for an earlier layer (cross-layer sharing of a latent, as in mistral_large4's
    ``kv_source_layers``, where each layer makes its own K/V from the shared latent, so no tensor is
    shared past views): its source is the first attention layer after the last one its K/V depend on."""
    position = {a.node: i for i, a in enumerate(found)}
    after: dict[Node, int] = {}  # node -> the last attention layer (by position) it depends on, -1 for none
    for node in graph.nodes:
        latest = max((after[i] for i in node.all_input_nodes), default=-1)
        after[node] = position.get(node, latest)
    for i, attn in enumerate(found):
        if attn.kv_source is not None or attn.keys is None or i == 0:
            continue
        latest = max(after[attn.keys], after[attn.values])
        if latest < i - 1:
            attn.kv_source = found[latest + 1].layer
