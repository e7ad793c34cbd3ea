"""The attention layers of a graph, in graph order, with their KV-sharing relation.

Invariants: reads only; the relation comes from the op's own ``layer`` / ``kv_source`` arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from fx_fastprefill.attention_op import ATTENTION_OP, KV_SOURCE, LAYER, SLIDING_WINDOW


@dataclass
class AttentionNode:
    node: Node
    layer: str
    kv_source: str | None
    sliding_window: int | None

    @property
    def shares_kv(self) -> bool:
        return self.kv_source is not None


def find_attention_nodes(graph: Graph) -> list[AttentionNode]:
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is ATTENTION_OP:
            found.append(AttentionNode(node, node.args[LAYER], node.args[KV_SOURCE], node.args[SLIDING_WINDOW]))
    return found
