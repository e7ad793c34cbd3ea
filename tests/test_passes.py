"""Each pass of the pipeline on one small hand-written graph: what it reads, what it changes.

The graph: two attention layers, the second reading the first's K/V, then the model's own gather
of the logits rows. Traced to aten with symbolic sizes, like the backend's graphs.
"""

from __future__ import annotations

import pytest
import sympy
import torch

from fx_fastprefill.ops import attention, sdpa  # noqa: F401  (the ops' kernels and fake kernels)
from fx_fastprefill.passes.pipeline import (PIPELINE, UNCHANGED, Decline, PassContext, PipelineOptions, copy_for_cut,
                                           run_pipeline, unchanged_pieces)
from fx_fastprefill.ops.schema import ATTENTION_OP, K, KV_WRITTEN, QUERY_ROWS, V, WRITE_KV_OP
from fx_fastprefill.passes.cut_graph import cut_graph
from fx_fastprefill.passes.fx_utils import arg, arg_position, module_path, placeholders
from fx_fastprefill.passes.split_pieces import GRAPH
from fx_fastprefill.passes.gather_hoisting import analyze
from fx_fastprefill.passes.link_kv_sources import link_kv_sources
from fx_fastprefill.passes.meta_keys import BOUNDARY_GATHER, ROLE
from fx_fastprefill.passes.split_regions import FULL, REDUCED, split_regions
from tests.helpers import aten_graph

aten = torch.ops.aten
T, R, DIM = 7, 3, 8


def two_layers(x, idx, wq, wkv, wo):
    h = x
    q = (h @ wq).view(-1, 2, 4)
    k, v = (h @ wkv).view(-1, 2, 2, 4).unbind(1)
    h = h + torch.ops.fx_fastprefill.attention(q, k, v, "a", None, None, None, None, None).reshape(-1, DIM)
    q = (h @ wq).view(-1, 2, 4)
    h = h + torch.ops.fx_fastprefill.attention(q, None, None, "b", "a", None, None, None, None).reshape(-1, DIM)
    return (h[idx] @ wo,)


def graph():
    inputs = (torch.randn(T, DIM), torch.tensor([2, 4, 6]), torch.randn(DIM, DIM), torch.randn(DIM, 2 * DIM),
              torch.randn(DIM, 5))
    return aten_graph(two_layers, *inputs, dynamic={0: [0], 1: [0]})


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def symbols(node):
    val = node.meta["val"]
    return set().union(*(s.node.expr.free_symbols for s in val.shape if isinstance(s, torch.SymInt)))


def test_link_kv_sources_makes_the_cache_write_a_node_and_the_sharing_read_a_dependency():
    gm = graph()
    assert not calls(gm, WRITE_KV_OP)
    layers = link_kv_sources(gm)
    a, b = calls(gm, ATTENTION_OP)
    [write] = calls(gm, WRITE_KV_OP)
    assert [(x.layer, x.kv_source) for x in layers] == [("a", None), ("b", "a")]
    assert write.args[:2] == (a.args[K], a.args[V]) and a.args[KV_WRITTEN] is write
    # The sharing call reads the source's K/V nodes and waits for its write.
    assert (b.args[K], b.args[V], b.args[KV_WRITTEN]) == (a.args[K], a.args[V], write)


def test_analysis_reduces_both_layers_queries_and_keeps_kv_whole():
    gm = graph()
    link_kv_sources(gm)
    plan = analyze(gm)
    a, b = calls(gm, ATTENTION_OP)
    assert set(plan.reduced_attention) == {a, b}
    assert plan.index.op == "placeholder" and plan.index.meta["val"].shape[0].node.expr == plan.reduced_rows
    assert plan.suffix is None
    # K/V (and the write) feed every later token: never in the region.
    assert a.args[K] not in plan.region and a.args[V] not in plan.region
    assert {s.node.name for s in plan.stops} <= {n.name for n in gm.graph.nodes}


def test_cut_gathers_at_the_boundary_and_reexpresses_sizes_in_the_logits_rows():
    gm = graph()
    link_kv_sources(gm)
    plan = analyze(gm)
    rows, reduced = plan.rows, plan.reduced_rows
    gathers = cut_graph(gm, plan)
    gm.graph.lint()
    assert gathers and all(g.meta[ROLE] == BOUNDARY_GATHER for g in gathers)
    assert all(g.target in (aten.index.Tensor, aten.reshape.default) for g in gathers)
    assert not any(n.target is aten.index.Tensor and n.args[1] == [plan.index] and n not in gathers
                   for n in gm.graph.nodes), "the model's own gather must be gone"
    a, b = calls(gm, ATTENTION_OP)
    assert a.args[QUERY_ROWS] is plan.index and b.args[QUERY_ROWS] is plan.index
    assert reduced in symbols(a) and rows not in symbols(a)  # queries on R rows
    assert rows in symbols(a.args[K])  # K/V on T rows


def test_split_regions_full_then_reduced():
    gm = graph()
    link_kv_sources(gm)
    plan = analyze(gm)
    cut_graph(gm, plan)
    split = split_regions(gm)
    assert [n.target for n in split.graph.nodes if n.op == "call_module"] == [FULL, REDUCED]
    full, reduced = getattr(split, FULL), getattr(split, REDUCED)
    assert calls(full, WRITE_KV_OP) and not calls(full, ATTENTION_OP)
    assert len(calls(reduced, ATTENTION_OP)) == 2
    assert not any(plan.reduced_rows in symbols(n) for n in full.graph.nodes
                   if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor))


def test_pipeline_runs_every_pass_in_order_and_times_it():
    ctx = run_pipeline(PassContext(graph(), PipelineOptions()))
    assert not ctx.declined and list(ctx.seconds) == [p.__name__ for p in PIPELINE]
    assert ctx.split is not None and ctx.flops_cut < ctx.flops_full
    assert ctx.unchanged is not ctx.gm  # the cut worked on a copy


@pytest.mark.parametrize("options, reason", [
    (PipelineOptions(fast_prefill=False), "fast_prefill=False"),
])
def test_pipeline_declines_with_the_reason(options, reason):
    ctx = run_pipeline(PassContext(graph(), options))
    assert ctx.declined == reason and not ctx.failed and "copy_for_cut" not in ctx.seconds


def test_a_graph_compiled_unchanged_gets_its_pieces_from_the_pipeline():
    """With CUDA graphs, the pieces pass splits the graph that compiles unchanged too (region
    UNCHANGED): where a pass declines, and where the cut is declined after the pipeline (the ranks
    disagree). The compiler is then given pieces, and splits nothing itself."""
    def every_node_once(ctx):
        split, infos = ctx.pieces[UNCHANGED]
        ops = [n.target for i in infos for n in getattr(split, i.name).graph.nodes if n.op == "call_function"]
        assert sorted(map(str, ops)) == sorted(str(n.target) for n in ctx.unchanged.graph.nodes
                                               if n.op == "call_function")
        assert [n.name for n in placeholders(split)] == [n.name for n in placeholders(ctx.unchanged)]
        assert any(i.kind == GRAPH for i in infos)

    declined = run_pipeline(PassContext(graph(), PipelineOptions(fast_prefill=False, cudagraphs=True)))
    assert declined.declined == "fast_prefill=False" and list(declined.pieces) == [UNCHANGED]
    assert unchanged_pieces(declined) is declined.pieces[UNCHANGED] and "pieces" in declined.seconds
    every_node_once(declined)
    cut = run_pipeline(PassContext(graph(), PipelineOptions(cudagraphs=True)))
    assert sorted(cut.pieces) == sorted([FULL, REDUCED])
    cut.declined = "the ranks planned different cuts"
    unchanged_pieces(cut)
    assert list(cut.pieces) == [UNCHANGED]
    every_node_once(cut)
    assert run_pipeline(PassContext(graph(), PipelineOptions(fast_prefill=False))).pieces == {}


def test_an_error_after_the_copy_declines_and_an_error_before_it_is_raised():
    def broken(ctx):
        raise RuntimeError("boom")
    after = PIPELINE.index(copy_for_cut) + 1
    ctx = run_pipeline(PassContext(graph(), PipelineOptions()), PIPELINE[:after] + [broken] + PIPELINE[after:])
    assert ctx.failed and ctx.declined == "internal error in pass broken: RuntimeError: boom"
    assert calls(ctx.unchanged, WRITE_KV_OP) and not calls(ctx.unchanged, aten.index.Tensor)[1:]
    with pytest.raises(RuntimeError, match="boom"):
        run_pipeline(PassContext(graph(), PipelineOptions()), [broken] + PIPELINE)


def test_a_pass_can_decline():
    def never(ctx):
        raise Decline("not today")
    ctx = run_pipeline(PassContext(graph(), PipelineOptions()), PIPELINE[:2] + [never] + PIPELINE[2:])
    assert ctx.declined == "not today" and not ctx.failed and list(ctx.seconds)[-1] == "never"


def test_graph_dumps(tmp_path, monkeypatch):
    monkeypatch.setenv("FX_FASTPREFILL_DUMP_GRAPHS", str(tmp_path))
    run_pipeline(PassContext(graph(), PipelineOptions()))
    names = sorted(p.name.split("_", 2)[-1] for p in tmp_path.iterdir())
    assert names == ["cut.txt", "link.txt", "narrow.txt"]
    assert "fx_fastprefill.write_kv" in next(tmp_path.glob("*_link.txt")).read_text()


def test_symbols_are_distinct():
    gm = graph()
    link_kv_sources(gm)
    plan = analyze(gm)
    assert isinstance(plan.rows, sympy.Symbol) and isinstance(plan.reduced_rows, sympy.Symbol)
    assert plan.rows != plan.reduced_rows


def test_the_passes_load_no_kernel_runtime_or_inductor():
    """Layering: passes/ needs only the op schemas; the kernels (Triton), the runtime and Inductor
    are loaded by what runs or compiles a model."""
    import subprocess
    import sys
    script = ("import sys, fx_fastprefill.passes.gather_hoisting, fx_fastprefill.passes.cut_graph, "
              "fx_fastprefill.passes.split_pieces, fx_fastprefill.passes.narrow_sliced_producers; "
              "print(sorted(m for m in ('triton', 'fx_fastprefill.runtime', 'fx_fastprefill.ops.attention', "
              "'torch._inductor.compile_fx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("key", ["L['self'].model.layers[7].self_attn", "L['args'][0].model.layers[7].self_attn",
                                 "G['model'].model.layers.7.self_attn",
                                 "L['self']._modules['model']._modules['layers'][7].self_attn"])
def test_module_paths_drop_dynamos_root_however_it_reached_the_model(key):
    assert module_path(key) == "model.layers.7.self_attn"


def sized(x, idx, w):
    h = (x @ w).relu()
    return h.reshape(h.size(0), 2, -1).sum(1)[idx], torch.full((1,), h.size(0))


def test_a_size_read_off_a_region_tensor_needs_none_of_its_rows():
    """``sym_size(h, 0)`` (transformers' MoE reads the routing's token count this way under dynamic
    shapes) does not stop the hoist at ``h``: the region's view gets the size in R, and the full
    region's reader (here an output) the full size, spelled from the graph's inputs."""
    x, idx, w = torch.randn(T, DIM), torch.tensor([2, 4, 6]), torch.randn(DIM, DIM)
    gm = aten_graph(sized, x, idx, w, dynamic={0: [0], 1: [0]})
    relu = calls(gm, aten.relu.default)[0]
    lifted = calls(gm, aten.full.default)[0].args[1]  # AOT lifted T to an input; the MoE graph reads it off h
    with gm.graph.inserting_after(relu):
        size = gm.graph.call_function(aten.sym_size.int, (relu, 0))
    size.meta["val"] = relu.meta["val"].shape[0]
    lifted.replace_all_uses_with(size)
    gm.recompile()
    plan = analyze(gm)
    assert calls(gm, aten.mm.default)[0] in plan.region, plan.stops
    cut_graph(gm, plan)
    assert all(n.args[0].op == "placeholder" for n in calls(gm, aten.sym_size.int))
    # Inputs: the lifted sizes (by their values), then x, w, idx in the graph's order.
    tensors = iter((x, w, idx))
    args = [n.meta["val"].node.hint if isinstance(n.meta["val"], torch.SymInt) else next(tensors)
            for n in gm.graph.nodes if n.op == "placeholder"]
    for got, want in zip(gm(*args), sized(x, idx, w)):
        torch.testing.assert_close(got, want)


def test_matrix_product_flops_are_the_flop_counters():
    """Without attention, the estimate is what torch.utils.flop_counter counts on a real run."""
    import sympy
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode

    from fx_fastprefill.passes.flops import estimate_flops

    def f(x, w, b, y):
        return torch.addmm(b, x, w).relu() @ w.t(), torch.bmm(y, y.transpose(1, 2))

    args = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16), torch.randn(3, 8, 5))
    gm = make_fx(f, tracing_mode="fake")(*args)
    with FlopCounterMode(display=False) as counter:
        f(*args)
    assert estimate_flops(gm, sympy.Integer(8), sympy.Integer(1), 8) == counter.get_total_flops() > 0


def test_op_arguments_are_read_by_their_schema_names():
    """``arg``: positional or keyword as the call passes it, the schema's default where it is left
    out; a wrong name is an error, not a silent None."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    positional = graph.call_function(torch.ops.aten.slice.Tensor, (x, 1, 2))
    keyword = graph.call_function(torch.ops.aten.sum.dim_IntList, (x, [0]), {"keepdim": True})
    assert [arg(positional, n) for n in ("self", "dim", "start", "end", "step")] == [x, 1, 2, None, 1]
    assert arg(keyword, "keepdim") is True and arg(keyword, "dim") == [0]
    assert arg_position(torch.ops.aten.slice.Tensor, "end") == 3
    with pytest.raises(KeyError, match="has no argument 'dims'"):
        arg(keyword, "dims")
    bare = graph.call_function(torch.ops.aten.sum.dim_IntList, (x,))
    with pytest.raises(ValueError, match="lacks its argument 'dim'"):
        arg(bare, "dim")


def test_the_graph_after_each_rewrite_goes_to_the_structured_trace():
    """With torch's structured trace on (what ``TORCH_TRACE`` turns on), each rewriting pass's graph
    is an artifact named by its place and pass, with the graph's code as its payload."""
    import logging
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    trace_log = logging.getLogger("torch.__trace")
    handler, level = Keep(), trace_log.level
    trace_log.addHandler(handler)
    trace_log.setLevel(logging.DEBUG)
    try:
        run_pipeline(PassContext(graph(), PipelineOptions()))
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(level)
    artifacts = {r.metadata["artifact"]["name"]: r.payload for r in records
                 if "artifact" in r.metadata and r.metadata["artifact"]["name"].startswith("fx_fastprefill_")}
    assert sorted(name.split("_", 3)[-1] for name in artifacts) == ["cut", "link", "narrow"], sorted(artifacts)
    assert "fx_fastprefill.write_kv" in next(p for n, p in artifacts.items() if n.endswith("_link"))


def test_with_the_structured_trace_off_no_graph_is_printed(monkeypatch):
    """The trace's payload is made only while the trace is on: a compile pays nothing for it."""
    import logging
    from fx_fastprefill.passes import pipeline
    trace_log = logging.getLogger("torch.__trace")  # torch's own handler alone, as outside pytest
    torchs_own = [h for h in trace_log.handlers if type(h).__name__ == "LazyTraceHandler"]
    monkeypatch.setattr(trace_log, "handlers", torchs_own)
    monkeypatch.delenv("FX_FASTPREFILL_DUMP_GRAPHS", raising=False)
    printed = []
    monkeypatch.setitem(pipeline.REWRITES, pipeline.link, lambda ctx: printed.append(1) or "graph")
    run_pipeline(PassContext(graph(), PipelineOptions()))
    assert not printed
