"""Matrix products that contract over a handful of elements, computed as multiply-sums that
Inductor fuses, not by a GEMM library call.

Gemma 3n's AltUp predicts each of its 4 residual streams as a mix of all 4 (``einsum("st,tnd->snd",
coefs, streams)``): a ``bmm`` of ``[1, 4, 4]`` by ``[1, 4, T * D]``. cuBLAS runs it as a batched
GEMV split into many launches (12.6 of the 61 ms of a Gemma-3n-E2B 1x8192 prefill step on an
H100), each reading and writing the whole ``[4, T, D]`` activation. Written as sums of scaled rows
of ``b``, one per output row (``out[m] = a[m, 0] * b[0] + ... + a[m, 3] * b[3]``, concatenated), it
is one pointwise kernel (7.6 ms in that step: BENCHMARKS.md "Of the limit"). Inductor's C++ code
reads ``b`` once for all rows; its Triton code writes the concatenation as a masked pointwise
kernel in which each row reads ``b`` again (measured the same as a single broadcast sum). An
output of many rows (``[T, 4] @ [4, N]``) is a broadcast multiply and a sum over the contraction,
which Inductor unrolls into pointwise code (its ``unroll_reductions_threshold``).

Invariants:
- Runs on a graph about to be handed to Inductor (a region, a piece, or a graph compiled
  unchanged), after the cut: the passes that find attention and move the gather never see it.
- Only ``aten.mm`` and ``aten.bmm`` of floating tensors whose contraction size is a constant
  ``<= MAX_CONTRACTION``; anything else is left as it is.
- Values: products are summed in float32 (what a GEMM accumulates in) and rounded once to the
  output dtype; only the order of the additions may differ from the library's.
- The graph given is not changed: a graph with something to rewrite is copied first.
"""

from __future__ import annotations

import contextlib

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten

# Inductor unrolls a reduction over at most this many elements into pointwise code.
MAX_CONTRACTION = 8
# Up to this many output rows, each is written as its own sum (see _rewritten).
MAX_ROWS = 8
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _small_contraction(node: Node) -> bool:
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.bmm.default):
        return False
    a, b = (arg.meta.get("val") if isinstance(arg, Node) else None for arg in node.args[:2])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or not a.dtype.is_floating_point:
        return False
    k = a.shape[-1]
    return isinstance(k, int) and k <= MAX_CONTRACTION and a.dtype == b.dtype


def rewrite_small_contractions(gm: GraphModule) -> tuple[GraphModule, int]:
    """``gm``, or a copy with its small contractions rewritten, and how many were."""
    if not any(_small_contraction(n) for n in gm.graph.nodes):
        return gm, 0
    graph = Graph()
    remap: dict[Node, Node] = {}
    output = graph.graph_copy(gm.graph, remap)
    graph.output(output)
    copy = GraphModule(gm, graph)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in copy.graph.nodes]) or contextlib.nullcontext()
    count = 0
    for node in list(copy.graph.nodes):
        if _small_contraction(node):
            with copy.graph.inserting_before(node), fake_mode:
                node.replace_all_uses_with(_rewritten(copy.graph, node))
            copy.graph.erase_node(node)
            count += 1
    copy.recompile()
    return copy, count


def _rewritten(graph: Graph, node: Node) -> Node:
    """``mm(a, b)`` (``bmm`` likewise, with its batch dim) as multiply-sums, summed in float32."""
    a, b = node.args[:2]
    out = node.meta["val"]
    batch = 1 if node.target is aten.bmm.default else 0

    def call(target, *args) -> Node:
        new = graph.call_function(target, args)
        new.meta["val"] = target(*torch.fx.node.map_arg(args, lambda x: x.meta["val"]))
        return new

    if out.dtype in _LOW_PRECISION:
        a, b = (call(torch.ops.prims.convert_element_type.default, x, torch.float32) for x in (a, b))
    rows, inner = a.meta["val"].shape[batch:]
    if isinstance(rows, int) and rows <= MAX_ROWS:
        # Each output row a sum of the rows of b (Inductor's C++ code then reads b once for all rows).
        output_rows = []
        for m in range(rows):
            coefs = call(aten.select.int, a, batch, m)
            total = None
            for k in range(inner):
                coef = call(aten.select.int, coefs, batch, k)
                term = call(aten.mul.Tensor, call(aten.unsqueeze.default, coef, -1) if batch else coef,
                            call(aten.select.int, b, batch, k))
                total = term if total is None else call(aten.add.Tensor, total, term)
            output_rows.append(call(aten.unsqueeze.default, total, batch))
        summed = call(aten.cat.default, output_rows, batch)  # the graph is decomposed: no stack
    else:
        product = call(aten.mul.Tensor, call(aten.unsqueeze.default, a, batch + 2),
                       call(aten.unsqueeze.default, b, batch))
        summed = call(aten.sum.dim_IntList, product, [batch + 1])
    if out.dtype in _LOW_PRECISION:
        summed = call(torch.ops.prims.convert_element_type.default, summed, out.dtype)
    summed.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
    return summed
