"""Split a region into pieces at the package's own ops, for piecewise CUDA graphs.

The ops in the ``fx_fastprefill`` namespace (attention, the cache write, captured SDPA) read
per-step metadata on the host (sequence boundaries, cache slots), so they cannot be recorded in
a CUDA graph: they run eagerly between the pieces, and every piece is compiled and recorded alone.

Invariants:
- Reads the region; builds new graphs, changes nothing in it.
- The steps, run in order, compute every node of the region once: a step is either one package
  op (run eagerly) or a maximal run of the other call nodes between two such ops (a piece).
- A piece reads only region inputs and values of earlier steps; its outputs are exactly its
  values that later steps or the region's output read.
- Piece graphs name their nodes canonically (placeholders ``in_0``...; call nodes after their
  op), so two layers' identical pieces print the same code, which Inductor's graph cache can hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

PACKAGE_NAMESPACE = "fx_fastprefill"


def is_package_op(node: Node) -> bool:
    """A call of an op registered by this package (runs outside CUDA graphs)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == PACKAGE_NAMESPACE)


@dataclass
class Piece:
    """A run of graph nodes compiled and recorded as one unit."""
    module: GraphModule
    inputs: list[Node]   # region nodes the piece reads, in placeholder order
    outputs: list[Node]  # region nodes the piece computes that later steps read
    views_only: bool     # no kernel to launch (views, sizes): nothing to record


def _is_view(node: Node) -> bool:
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.is_view) or target in _SIZE_OPS


_SIZE_OPS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default}


@dataclass
class EagerOp:
    """One package op, run eagerly with the region's values."""
    node: Node


Step = Piece | EagerOp


def boundary(nodes: list[Node]) -> tuple[list[Node], list[Node]]:
    """What a run of nodes reads from outside it (in first-use order), and which of its nodes are read outside it."""
    members = set(nodes)
    inputs: list[Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in inputs:
                inputs.append(arg)
    return inputs, [n for n in nodes if any(u not in members for u in n.users)]


def _piece(gm: GraphModule, nodes: list[Node], index: int) -> Piece:
    inputs, outputs = boundary(nodes)
    graph = Graph()
    env: dict[Node, Node] = {}
    for i, node in enumerate(inputs):
        placeholder = graph.placeholder(f"in_{i}")
        placeholder.meta = dict(node.meta)
        env[node] = placeholder
    for node in nodes:
        copy = graph.create_node(node.op, node.target, torch.fx.node.map_arg(node.args, env.__getitem__),
                                 torch.fx.node.map_arg(node.kwargs, env.__getitem__))
        copy.meta = dict(node.meta)
        env[node] = copy
    graph.output(tuple(env[n] for n in outputs))
    return Piece(GraphModule(gm, graph, f"piece_{index}"), inputs, outputs, all(_is_view(n) for n in nodes))


def split_at_attention(gm: GraphModule) -> list[Step]:
    """The region's steps in order: pieces and the package ops between them."""
    steps: list[Step] = []
    run: list[Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if is_package_op(node):
            if run:
                steps.append(_piece(gm, run, len(steps)))
                run = []
            steps.append(EagerOp(node))
        else:
            run.append(node)
    if run:
        steps.append(_piece(gm, run, len(steps)))
    return steps
