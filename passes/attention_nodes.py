"""The attention layers of a graph, in graph order, with their KV-sharing relation.

Two kinds of attention node:
- ``fx_fastprefill::attention`` (flat convention): the relation is the op's own ``layer`` /
  ``kv_source`` arguments.
- ``fx_fastprefill::sdpa`` (transformers models, see passes/capture_sdpa.py): the relation is
  dataflow. A layer shares K/V when its K and V arguments, followed back through views, expands
  and copies (each layer's own GQA repeat), are the same tensors as an earlier layer's; its source
  is the first layer that used them.

Invariants: reads only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fx_fastprefill.ops.schema import (ATTENTION_OP, KV_SOURCE, LAYER, SDPA_K, SDPA_LAYER, SDPA_MASK, SDPA_OP, SDPA_V,
                                       SLIDING_WINDOW)

from .fx_utils import is_whole_slice

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
    masked: bool = False  # sdpa with the model's own mask (its window, if any, lives in the mask)

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


def find_attention_nodes(graph: Graph) -> list[AttentionNode]:
    found = []
    owners: dict[tuple[Node, Node], str] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is ATTENTION_OP:
            found.append(AttentionNode(node, node.args[LAYER], node.args[KV_SOURCE], node.args[SLIDING_WINDOW]))
        elif node.target is SDPA_OP:
            roots = (kv_root(node.args[SDPA_K]), kv_root(node.args[SDPA_V]))
            source = owners.setdefault(roots, node.args[SDPA_LAYER])
            kv_source = None if source == node.args[SDPA_LAYER] else source
            found.append(AttentionNode(node, node.args[SDPA_LAYER], kv_source, None, node.args[SDPA_MASK] is not None))
    return found
