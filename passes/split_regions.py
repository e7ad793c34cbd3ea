"""Split a cut graph into stages: the full region, the boundary gathers, the reduced region.

Invariants:
- Every call node belongs to exactly one stage; stages run in the order full, gathers, reduced,
  and a stage reads only graph inputs and values of earlier stages (the cut guarantees that no
  full-region node reads a reduced value).
- Each compiled stage is a standalone GraphModule whose placeholders carry the fake values of the
  nodes they stand for, so it can be handed to Inductor on its own.
- A full-region node whose every reader is in the reduced region (a weight's transpose, a
  constant's cast) moves there: the reduced region then reads the parameters themselves, which
  stay at fixed addresses (what its CUDA graphs need), and Inductor can fold the view into its
  reader. Package ops (the cache writes) never move: they run even when the reduced region does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, GraphModule, Node

from .cut_graph import BOUNDARY_GATHER, REDUCED_SIZE_NODE, downstream
from .split_at_attention import boundary, is_package_op

FULL, BOUNDARY, REDUCED = "full", "boundary", "reduced"


@dataclass
class Stage:
    name: str
    nodes: list[Node]
    inputs: list[Node]
    outputs: list[Node]
    module: GraphModule | None = None  # None for the boundary stage (run node by node)


def assign_regions(gm: GraphModule) -> dict[Node, str]:
    gathers = [n for n in gm.graph.nodes if n.meta.get("ffp_role") == BOUNDARY_GATHER]
    reduced = downstream(gathers + [n for n in gm.graph.nodes if n.meta.get("ffp_role") == REDUCED_SIZE_NODE])
    regions = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.meta.get("ffp_role") == BOUNDARY_GATHER:
            regions[node] = BOUNDARY
        elif node in reduced or node.meta.get("ffp_role") == REDUCED_SIZE_NODE:
            regions[node] = REDUCED
        else:
            regions[node] = FULL
    for node in reversed(list(gm.graph.nodes)):
        if (regions.get(node) == FULL and node.users and not is_package_op(node)
                and all(regions.get(user) == REDUCED for user in node.users)):
            regions[node] = REDUCED
    return regions


def extract_stage(gm: GraphModule, name: str, nodes: list[Node], build_module: bool = True) -> Stage:
    inputs, outputs = boundary(nodes)
    stage = Stage(name, nodes, inputs, outputs)
    if build_module:
        graph = Graph()
        env: dict[Node, Node] = {}
        for node in inputs:
            placeholder = graph.placeholder(node.name)
            placeholder.meta = dict(node.meta)
            env[node] = placeholder
        for node in nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in outputs))
        stage.module = GraphModule(gm, graph, f"{name}_region")
    return stage


def split_regions(gm: GraphModule) -> dict[str, Stage]:
    regions = assign_regions(gm)
    by_region: dict[str, list[Node]] = {FULL: [], BOUNDARY: [], REDUCED: []}
    for node, region in regions.items():
        by_region[region].append(node)
    return {
        FULL: extract_stage(gm, FULL, by_region[FULL]),
        BOUNDARY: extract_stage(gm, BOUNDARY, by_region[BOUNDARY], build_module=False),
        REDUCED: extract_stage(gm, REDUCED, by_region[REDUCED]),
    }
