"""The pass pipeline: the passes of ``passes/`` in order, over one :class:`PassContext`.

Every pass has one signature, ``pass_(ctx) -> None``; it reads and writes the context (the graph,
the plan, what the report will say) and declines a cut by raising :class:`Decline` with the reason.
The pipeline is the one place that catches it: the graph is then compiled unchanged and the report
says why. Each pass is timed (``ctx.seconds``). The graph after every pass that rewrites it goes to
torch's structured trace (``TORCH_TRACE=DIR``, read with tlparse: artifact
``fx_fastprefill_<k>_<pass>`` of the compile it belongs to) and, with
``FX_FASTPREFILL_DUMP_GRAPHS=DIR``, to a file of ``DIR`` (one per graph and pass).

Passes before ``copy_for_cut`` work on the graph that is compiled either way (linking the KV
sources is part of every compile); the cut works on a copy, so a decline at any later point leaves
nothing half-done. An unexpected error in a pass after the copy declines too, with the pass named
and the traceback logged: the pass never breaks a compile. Errors in the model itself (a bad
``kv_source``) are raised before the copy, as the user's errors.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from fx_fastprefill import torch_seams

from .attention_nodes import AttentionNode
from .cut_graph import CutError, cut_graph
from .eligible_layers import eligible_layers
from .flops import estimate_flops
from .fx_utils import placeholders
from .gather_hoisting import HoistPlan, NoCut, analyze
from .link_kv_sources import link_kv_sources
from .narrow_sliced_producers import Narrowed, narrow_sliced_producers
from .split_pieces import PieceInfo, split_pieces
from .split_regions import FULL, REDUCED, assign_regions, region_static_idxs, split_regions

log = logging.getLogger("fx_fastprefill")

DUMP_ENV = "FX_FASTPREFILL_DUMP_GRAPHS"
NO_ATTENTION = ("the graph has no attention the pass knows (fx_fastprefill.attention, SDPA, or eager attention: "
                "Q @ K^T -> softmax -> @ V)")
HOIST_STOPPED = "the hoist stopped before any attention layer"
UNCHANGED = "unchanged"  # ctx.pieces' key for a graph compiled unchanged
_graph_ids = itertools.count()


class Decline(Exception):
    """The pass leaves this graph uncut; the message is the report's reason."""


@dataclass
class PipelineOptions:
    fast_prefill: bool = True
    draft_layers: tuple[str, ...] = ()
    narrow_slices: bool = True
    prompt_len: int = 2048
    cudagraphs: bool = False  # piecewise CUDA graphs for this graph: its regions split into pieces


@dataclass
class PassContext:
    """What the passes share. ``gm`` is the graph being worked on; ``unchanged`` is what compiles
    on a decline (the linked graph, before the cut's copy)."""
    gm: GraphModule
    options: PipelineOptions
    unchanged: GraphModule | None = None
    static_inputs: set[Node] = field(default_factory=set)  # placeholders read in place (parameters)
    copies: dict[Node, Node] = field(default_factory=dict)  # unchanged graph's node -> its copy
    layers: list[AttentionNode] = field(default_factory=list)
    eligible: list[str] = field(default_factory=list)
    plan: HoistPlan | None = None
    narrowed: list[Narrowed] = field(default_factory=list)
    flops_full: float = 0.0
    flops_cut: float = 0.0
    split: GraphModule | None = None  # the cut graph as calls of its full and reduced regions
    regions: dict[Node, str] = field(default_factory=dict)  # each node of the cut graph -> FULL or REDUCED
    region_static_idxs: dict[str, list[int]] = field(default_factory=dict)  # region -> inputs read in place
    pieces: dict[str, tuple[GraphModule, list[PieceInfo]]] = field(default_factory=dict)  # region -> its pieces
    declined: str = ""
    failed: bool = False  # declined by an error in a pass (counted as a fallback), not by a rule
    seconds: dict[str, float] = field(default_factory=dict)


Pass = Callable[[PassContext], None]


def link(ctx: PassContext) -> None:
    ctx.layers = link_kv_sources(ctx.gm)
    ctx.unchanged = ctx.gm


def find_eligible(ctx: PassContext) -> None:
    ctx.eligible = eligible_layers(ctx.layers, ctx.options.draft_layers, ctx.options.fast_prefill)


def require_enabled(ctx: PassContext) -> None:
    if not ctx.options.fast_prefill:
        raise Decline("fast_prefill=False")


def copy_for_cut(ctx: PassContext) -> None:
    graph = torch.fx.Graph()
    for node in ctx.gm.graph.nodes:
        ctx.copies[node] = graph.node_copy(node, lambda n: ctx.copies[n])
    ctx.gm = GraphModule(ctx.gm, graph)  # meta dicts are copied shallowly: fake values are shared


def hoist(ctx: PassContext) -> None:
    try:
        ctx.plan = analyze(ctx.gm)
    except NoCut as e:
        raise Decline(f"{NO_ATTENTION}; {e}" if not ctx.layers else str(e)) from None
    ctx.flops_full = estimate_flops(ctx.gm, ctx.plan.rows, ctx.plan.reduced_rows, ctx.options.prompt_len)


def narrow(ctx: PassContext) -> None:
    if not ctx.options.narrow_slices:
        return
    ctx.narrowed = narrow_sliced_producers(ctx.gm, ctx.plan)
    if ctx.narrowed:
        ctx.plan = analyze(ctx.gm)  # the reduced slices' producers can now join the reduced region


def require_reduced_attention(ctx: PassContext) -> None:
    if ctx.plan.reduced_attention:
        return
    # The report adds the first stop in the user's words (report/builder.py).
    raise Decline(HOIST_STOPPED if ctx.layers else NO_ATTENTION)


def cut(ctx: PassContext) -> None:
    try:
        cut_graph(ctx.gm, ctx.plan)
    except CutError as e:
        raise Decline(f"the cut could not be applied: {e}") from None


def split(ctx: PassContext) -> None:
    ctx.regions = assign_regions(ctx.gm)
    ctx.split = split_regions(ctx.gm, ctx.regions)
    static_names = {ctx.copies.get(n, n).name for n in ctx.static_inputs}
    ctx.region_static_idxs = {name: region_static_idxs(ctx.split, name, static_names) for name in (FULL, REDUCED)}
    ctx.flops_cut = estimate_flops(ctx.gm, ctx.plan.rows, ctx.plan.reduced_rows, ctx.options.prompt_len)


def pieces(ctx: PassContext) -> None:
    """With piecewise CUDA graphs, each region split into the pieces recorded as graphs and the
    ops that run eagerly between them (passes/split_pieces.py); for a declined cut, the graph that
    compiles unchanged, as region ``UNCHANGED``. The compiler only compiles the pieces it is given."""
    if not ctx.options.cudagraphs:
        return
    if ctx.declined:
        graph = ctx.unchanged or ctx.gm
        static_idxs = [i for i, n in enumerate(placeholders(graph)) if n in ctx.static_inputs]
        ctx.pieces = {UNCHANGED: split_pieces(graph, static_idxs)}
        return
    ctx.pieces = {name: split_pieces(getattr(ctx.split, name), ctx.region_static_idxs[name])
                  for name in (FULL, REDUCED)}


def unchanged_pieces(ctx: PassContext) -> tuple[GraphModule, list[PieceInfo]]:
    """The pieces of a declined graph, which compiles unchanged: the pieces pass's, run now where
    the cut was declined after the pipeline (the ranks disagree, its regions failed to compile)."""
    if UNCHANGED not in ctx.pieces:
        _timed(ctx, pieces)
    return ctx.pieces[UNCHANGED]


PIPELINE: list[Pass] = [link, find_eligible, require_enabled, copy_for_cut, hoist, narrow,
                        require_reduced_attention, cut, split, pieces]
# Passes that rewrite the graph (dumped with FX_FASTPREFILL_DUMP_GRAPHS), and what is dumped.
REWRITES: dict[Pass, Callable[[PassContext], str]] = {
    link: lambda ctx: ctx.gm.print_readable(print_output=False),
    narrow: lambda ctx: ctx.gm.print_readable(print_output=False),
    cut: lambda ctx: ctx.gm.print_readable(print_output=False),
    pieces: lambda ctx: "\n".join(f"# {name}\n" + split.print_readable(print_output=False)
                                   for name, (split, _) in ctx.pieces.items()),
}


def _dump(ctx: PassContext, pass_: Pass, name: str, path: Path | None) -> None:
    """The graph ``pass_`` left, to the structured trace while it writes, and to ``path``; printed
    only if either wants it."""
    tracing = torch_seams.structured_trace_on()
    text = REWRITES[pass_](ctx) if tracing or path else ""
    if not text:
        return
    if tracing:
        torch_seams.trace_artifact(f"fx_fastprefill_{name}", text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _timed(ctx: PassContext, pass_: Pass) -> None:
    start = time.perf_counter()
    try:
        pass_(ctx)
    finally:
        ctx.seconds[pass_.__name__] = ctx.seconds.get(pass_.__name__, 0.0) + time.perf_counter() - start


def run_pipeline(ctx: PassContext, passes: list[Pass] = PIPELINE) -> PassContext:
    """Run ``passes`` in order; a :class:`Decline` (or an error after ``copy_for_cut``) stops them
    and sets ``ctx.declined``."""
    dump = os.environ.get(DUMP_ENV)
    graph_id = next(_graph_ids)
    copied = False
    for k, pass_ in enumerate(passes):
        name = pass_.__name__
        start = time.perf_counter()
        try:
            pass_(ctx)
        except Decline as e:
            ctx.declined = str(e)
        except Exception as e:
            if not copied:
                raise
            log.warning("pass %s failed; the graph is compiled unchanged", name, exc_info=True)
            ctx.declined, ctx.failed = f"internal error in pass {name}: {type(e).__name__}: {e}", True
        finally:
            ctx.seconds[name] = time.perf_counter() - start
        copied = copied or pass_ is copy_for_cut
        if ctx.declined:
            log.debug("pass %s declined the cut: %s", name, ctx.declined)
            if ctx.unchanged is not None and ctx.options.cudagraphs:  # it compiles unchanged: its pieces
                _timed(ctx, pieces)
            break
        if pass_ in REWRITES:
            _dump(ctx, pass_, f"{k:02d}_{name}", dump and Path(dump) / f"graph{graph_id}_{k:02d}_{name}.txt")
    log.debug("pass times (ms): %s", {n: round(1000 * s, 2) for n, s in ctx.seconds.items()})
    return ctx
