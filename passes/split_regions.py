"""Split a cut graph into its two regions with ``split_module``: the full region, then the reduced
region (the boundary gathers first, then everything computed on the logits rows).

Invariants:
- Every call node belongs to exactly one region; the full region reads only graph inputs (the cut
  guarantees that no full-row node reads a reduced value), so it runs first.
- Each region is a submodule of the returned GraphModule (``full``, ``reduced``) whose
  placeholders carry the fake values of the nodes they stand for, so it can be compiled on its own;
  the top-level graph only calls the two and unpacks their outputs.
- A full-region node whose every reader is in the reduced region (a weight's transpose, a
  constant's cast) moves there: the reduced region then reads the parameters themselves, which
  stay at fixed addresses (what its CUDA graphs need), and Inductor can fold the view into its
  reader. Package ops (the cache writes) never move: they run even when the reduced region does not.
- ``assign_regions`` still names the gathers ``boundary``: the printed graph shows them apart.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module

from fx_fastprefill.ops.schema import is_package_op

from .meta_keys import BOUNDARY_GATHER, REDUCED_SIZE_NODE, ROLE
from .fx_utils import downstream

FULL, BOUNDARY, REDUCED = "full", "boundary", "reduced"
_PARTITION = {FULL: 0, BOUNDARY: 1, REDUCED: 1}


def assign_regions(gm: GraphModule) -> dict[Node, str]:
    """The region of every call node: full, boundary (the gathers) or reduced."""
    gathers = [n for n in gm.graph.nodes if n.meta.get(ROLE) == BOUNDARY_GATHER]
    reduced = downstream(gathers + [n for n in gm.graph.nodes if n.meta.get(ROLE) == REDUCED_SIZE_NODE])
    regions = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.meta.get(ROLE) == BOUNDARY_GATHER:
            regions[node] = BOUNDARY
        elif node in reduced or node.meta.get(ROLE) == REDUCED_SIZE_NODE:
            regions[node] = REDUCED
        else:
            regions[node] = FULL
    for node in reversed(list(gm.graph.nodes)):
        if (regions.get(node) == FULL and node.users and not is_package_op(node)
                and all(regions.get(user) == REDUCED for user in node.users)):
            regions[node] = REDUCED
    return regions


def split_regions(gm: GraphModule, regions: dict[Node, str] | None = None) -> GraphModule:
    """``gm`` as a GraphModule that calls its ``full`` and ``reduced`` region submodules
    (``regions``: :func:`assign_regions` of ``gm``, where the caller has it)."""
    regions = assign_regions(gm) if regions is None else regions
    # Not keep_original_order=True: torch's split_module then fails on cut graphs (KeyError on a
    # getitem node, tests/test_passes.py); two regions, the reduced reading the full, need no order.
    split = split_module(gm, gm, lambda node: _PARTITION[regions[node]])
    for name, region in (("submod_0", FULL), ("submod_1", REDUCED)):
        if not hasattr(split, name):
            raise ValueError(f"the cut graph has no {region} region")
    return rename_submodules(split, {"submod_0": FULL, "submod_1": REDUCED})


def region_static_idxs(split: GraphModule, region: str, static_names: set[str]) -> list[int]:
    """The positions of ``region``'s inputs that are read in place (named in ``static_names``)."""
    call = next(n for n in split.graph.nodes if n.op == "call_module" and n.target == region)
    return [i for i, a in enumerate(call.args) if isinstance(a, Node) and a.name in static_names]


def rename_submodules(split: GraphModule, names: dict[str, str]) -> GraphModule:
    """Call ``split``'s submodules by ``names`` (``submod_3`` -> ``piece_3``): what a report or a
    profile shows."""
    for node in split.graph.nodes:
        if node.op == "call_module" and node.target in names:
            module = getattr(split, node.target)
            delattr(split, node.target)
            setattr(split, names[node.target], module)
            node.target = names[node.target]
    split.recompile()
    return split
