"""Split a region into pieces for piecewise CUDA graphs: maximal runs of ordinary nodes, cut at
the package's ops and the boundary gathers, with ``split_module``.

The ops in the ``fx_fastprefill`` namespace (attention, the cache write, captured SDPA) read
per-step metadata on the host (sequence boundaries, cache slots), so they cannot be recorded in
a CUDA graph; the boundary gathers read T-sized tensors, and recording them would record every
reduced piece once per (T, R) instead of once per R. Both run eagerly between the pieces.

Layers of one kind should give equal pieces, so that each such piece compiles once
(:func:`piece_signature`, compilation/cudagraphs.py). Views that pick a layer's slice of a shared
input (``select(per_layer_inputs, 1, i)``) made them differ, so a run's views of values computed
outside it move ahead of it, into a views-only piece. Views of inputs read in place (parameters)
stay with their readers, where Inductor folds them.

Invariants:
- Moves views of values from outside a run ahead of that run in the region (views have no
  effect; nothing else moves, so package ops and gathers keep their order).
- Returns a new GraphModule whose submodules ``piece_<i>`` run in order and compute every node of
  the region once. ``PieceInfo.kind`` says what each is: ``eager`` (package ops or gathers, run as
  they are), ``views`` (views and sizes only: nothing to launch), ``graph`` (compiled and recorded).
- A piece reads only region inputs and values of earlier pieces.
- Piece graphs name their placeholders ``in_0``...; two pieces with equal signatures compute the
  same function of their inputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_map_only

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


def split_pieces(region: GraphModule, static_input_idxs: Iterable[int] = ()) -> tuple[GraphModule, list[PieceInfo]]:
    """The region as a GraphModule calling its pieces in order, and what each piece is.
    ``static_input_idxs``: the region inputs read in place (their views stay in their pieces)."""
    inputs = [n for n in region.graph.nodes if n.op == "placeholder"]
    in_place = {inputs[i] for i in static_input_idxs}
    # Each call node's run (a maximal stretch of eager or of ordinary nodes), and whether it is a
    # view of values from outside its run, lifted into a views piece ahead of it.
    run: dict[Node, int] = {}
    lifted: set[Node] = set()
    eager_runs: list[bool] = []
    for node in region.graph.nodes:
        if node.op != "call_function":
            continue
        eager = runs_eagerly(node)
        if not eager_runs or eager_runs[-1] != eager:
            eager_runs.append(eager)
        run[node] = len(eager_runs) - 1
        if not eager and _is_view(node) and all(
                (a.op == "placeholder" and a not in in_place) or a in lifted or run.get(a, run[node]) < run[node]
                for a in node.all_input_nodes):
            lifted.add(node)
    if not run:
        raise ValueError("a region without call nodes has no pieces")
    _move_ahead_of_their_runs(region, run, lifted)
    keys = sorted({(run[n], n not in lifted) for n in run})
    index = {key: i for i, key in enumerate(keys)}
    partition = {n: index[(run[n], n not in lifted)] for n in run}
    split = split_module(region, region, partition.__getitem__, keep_original_order=True)
    members: dict[int, list[Node]] = {}
    for node, i in partition.items():
        members.setdefault(i, []).append(node)
    pieces = []
    for i, (k, _) in enumerate(keys):
        kind = EAGER if eager_runs[k] else VIEWS if all(_is_view(n) for n in members[i]) else GRAPH
        pieces.append(PieceInfo(f"piece_{i}", kind))
    split = rename_submodules(split, {f"submod_{i}": p.name for i, p in enumerate(pieces)})
    for piece in pieces:
        _canonical_inputs(getattr(split, piece.name))
    return split, pieces


def _move_ahead_of_their_runs(region: GraphModule, run: dict[Node, int], lifted: set[Node]) -> None:
    """Each lifted view just before its run's first node (what it reads comes earlier still)."""
    first: dict[int, Node] = {}
    for node in region.graph.nodes:
        if node in run and node not in lifted:
            first.setdefault(run[node], node)
    for node in [n for n in region.graph.nodes if n in lifted]:
        if run[node] in first:
            first[run[node]].prepend(node)
    if lifted:
        region.recompile()


def _canonical_inputs(piece: GraphModule) -> None:
    for i, node in enumerate(n for n in piece.graph.nodes if n.op == "placeholder"):
        node._rename(f"in_{i}")
        node.target = node.name  # the forward's argument name
    piece.recompile()


def piece_signature(piece: GraphModule, static_input_idxs: Iterable[int]) -> tuple:
    """What a piece's compiled code depends on, names aside: each node's op, target and arguments
    (other nodes by position), its inputs' dtypes, sizes, strides and devices (the symbols of one
    shape environment), which inputs are read in place, and the identity of any constant it reads
    (an attribute, or a tensor among the arguments).
    Two pieces with one signature can share one compiled function."""
    position: dict[Node, int] = {}
    ops = []
    for node in piece.graph.nodes:
        position[node] = len(position)
        args = map_arg((node.args, node.kwargs), lambda n: _Ref(position[n]))
        # A tensor in the arguments by identity: its printed form elides values.
        args = tree_map_only(torch.Tensor, lambda t: f"tensor@{id(t)}", args)
        if node.op == "placeholder":
            ops.append(("placeholder", _describe(node.meta.get("val"))))
        elif node.op == "get_attr":
            ops.append(("get_attr", id(functools.reduce(getattr, node.target.split("."), piece))))
        else:
            ops.append((node.op, str(node.target), repr(args)))
    return tuple(ops), tuple(static_input_idxs)


class _Ref(int):
    def __repr__(self) -> str:
        return f"%{int(self)}"


def _describe(val: object) -> tuple:
    if isinstance(val, torch.Tensor):
        return str(val.dtype), str(tuple(val.shape)), str(val.stride()), str(val.device)
    return type(val).__name__, str(val)
