"""Helpers shared by the tests: random prompts, tiny traced graphs, where a product runs."""

from __future__ import annotations

import random

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from fx_fastprefill.passes.split_regions import assign_regions

aten = torch.ops.aten


def random_prompts(n, lo, hi, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def trace(fn, *shapes, dtypes=None) -> GraphModule:
    """An aten graph of ``fn`` on random inputs of ``shapes``, every size symbolic (like the
    backend's graphs); integer inputs where ``dtypes`` says so."""
    dtypes = dtypes or [torch.float32] * len(shapes)
    inputs = [torch.randint(0, 3, s) if d in (torch.int64, torch.int32) else torch.randn(s, dtype=d)
              for s, d in zip(shapes, dtypes)]
    return make_fx(fn, tracing_mode="symbolic")(*inputs)


def first(gm: GraphModule, target) -> Node:
    return next(n for n in gm.graph.nodes if n.target == target)


def rows_of(gm: GraphModule, position: int = 0, dim: int = 0):
    """The size symbol of dim ``dim`` of input ``position``: the token count of a test graph."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return inputs[position].meta["val"].shape[dim].node.expr


def products_of(report, weight_name):
    """(region, rows of the weight read) of every mm whose weight operand comes from ``weight_name``."""
    gm = report.graph
    regions = assign_regions(gm)
    names = dict(report.placeholder_names)
    found = []
    for node in gm.graph.nodes:
        if node.target is not aten.mm.default:
            continue
        weight, rows = node.args[1], None
        while weight.op == "call_function":
            if weight.target is aten.slice.Tensor:
                rows = (weight.args[2], weight.args[3])
            weight = weight.args[0]
        if names.get(weight) == weight_name:
            found.append((regions[node], rows))
    return found


def aten_graph(fn, *inputs, dynamic: dict[int, list[int]] | None = None) -> GraphModule:
    """The post-AOT aten graph the backend's passes see for ``fn(*inputs)``: the dims in ``dynamic``
    ({input position: dims}) are symbolic, every other size is static (weights are)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    captured = []

    class Captured(Exception):
        pass

    def capture(gm, example_inputs):
        def keep(aten_gm, aten_inputs):
            captured.append(aten_gm)
            raise Captured  # nothing runs: the graph may call ops that need a step
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, inference_compiler=keep)

    for position, dims in (dynamic or {}).items():
        for dim in dims:
            torch._dynamo.mark_dynamic(inputs[position], dim)
    torch._dynamo.reset()
    try:
        with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False):
            torch.compile(fn, backend=capture, dynamic=False, fullgraph=True)(*inputs)
    except Exception:
        if not captured:
            raise
    return captured[-1]
