"""Split a region into pieces for piecewise CUDA graphs: maximal runs of ordinary nodes, cut at
the package's ops and the boundary gathers, with ``split_module``.

The ops in the ``fx_fastprefill`` namespace (attention, the cache write, captured SDPA) read
per-step metadata on the host (sequence boundaries, cache slots), so they cannot be recorded in
a CUDA graph; the boundary gathers read T-sized tensors, and recording them would record every
reduced piece once per (T, R) instead of once per R. Both run eagerly between the pieces.

Invariants:
- Reads the region; returns a new GraphModule whose submodules ``piece_<i>`` run in order and
  compute every node of the region once. ``PieceInfo.kind`` says what each is: ``eager`` (package
  ops or gathers, run as they are), ``views`` (views and sizes only: nothing to launch), ``graph``
  (compiled and recorded).
- A piece reads only region inputs and values of earlier pieces.
- Piece graphs name their nodes canonically (placeholders ``in_0``...; call nodes after their op),
  so two layers' identical pieces print the same code, which Inductor's graph cache can hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module

from fx_fastprefill.ops.schema import is_package_op

from .meta_keys import BOUNDARY_GATHER, ROLE
from .split_regions import rename_submodules

EAGER, VIEWS, GRAPH = "eager", "views", "graph"
_SIZE_OPS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default}


@dataclass
class PieceInfo:
    name: str
    kind: str  # EAGER, VIEWS or GRAPH


def runs_eagerly(node: Node) -> bool:
    """A node kept out of CUDA graphs: a package op, or a boundary gather (and the sizes it needs)."""
    return is_package_op(node) or node.meta.get(ROLE) == BOUNDARY_GATHER


def _is_view(node: Node) -> bool:
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.is_view) or target in _SIZE_OPS


def split_pieces(region: GraphModule) -> tuple[GraphModule, list[PieceInfo]]:
    """The region as a GraphModule calling its pieces in order, and what each piece is."""
    partition: dict[Node, int] = {}
    kinds: list[str] = []
    for node in region.graph.nodes:
        if node.op != "call_function":
            continue
        eager = runs_eagerly(node)
        if not kinds or (kinds[-1] == EAGER) != eager:
            kinds.append(EAGER if eager else GRAPH)
        partition[node] = len(kinds) - 1
    if not partition:
        raise ValueError("a region without call nodes has no pieces")
    split = split_module(region, region, partition.__getitem__, keep_original_order=True)
    members: dict[int, list[Node]] = {}
    for node, index in partition.items():
        members.setdefault(index, []).append(node)
    pieces = []
    for index, kind in enumerate(kinds):
        if kind == GRAPH and all(_is_view(n) for n in members[index]):
            kind = VIEWS
        pieces.append(PieceInfo(f"piece_{index}", kind))
    split = rename_submodules(split, {f"submod_{i}": p.name for i, p in enumerate(pieces)})
    for piece in pieces:
        _canonical_inputs(getattr(split, piece.name))
    return split, pieces


def _canonical_inputs(piece: GraphModule) -> None:
    for i, node in enumerate(n for n in piece.graph.nodes if n.op == "placeholder"):
        node._rename(f"in_{i}")
        node.target = node.name  # the forward's argument name
    piece.recompile()
