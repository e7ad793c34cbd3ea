"""Where the pass cannot prove a cut safe it leaves the graph unchanged, says why, and the model
still computes what it computes without the pass."""

import pytest
import torch

import fx_fastprefill
from fx_fastprefill import fallbacks
from fx_fastprefill.passes import pipeline
from tests.helpers import Variant


@pytest.mark.parametrize("ending, reason", [
    ("all_rows", "no row selection to hoist"),
    # the last hidden state also feeds an op on all rows (a gather of 2T rows): nothing can move
    ("two_token_counts", "the hoist stopped before any attention layer: "),
    ("flattened_output", "is computed from the logits rows but does not keep them on one dim"),
    ("row_mixing_after_last_layer", "the hoist stopped before any attention layer"),
])
def test_left_unchanged_with_the_reason(ending, reason):
    torch.manual_seed(0)
    model = Variant(ending)
    backend = fx_fastprefill.backend(compiler="eager")
    fast = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=16, max_model_len=32)
    ref = fx_fastprefill.Runner(model, max_num_tokens=16, max_model_len=32)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    torch.testing.assert_close(fast.prefill(prompts), ref.prefill(prompts), rtol=1e-4, atol=1e-4)
    report = backend.reports[0]
    assert not report.cut and reason in report.reason, report.reason
    assert report.eligible_layers == ["b"]  # the analysis of the layers still stands


def test_row_mixing_op_is_named_where_the_hoist_stopped():
    torch.manual_seed(0)
    backend = fx_fastprefill.backend(compiler="eager")
    fx_fastprefill.Runner(Variant("row_mixing_after_last_layer"), backend=backend, max_num_tokens=16).prefill(
        [[1, 2, 3]]
    )
    assert "aten.cumsum" in backend.reports[0].reason


def test_fast_prefill_false_is_the_baseline():
    torch.manual_seed(0)
    backend = fx_fastprefill.backend(compiler="eager", fast_prefill=False)
    fx_fastprefill.Runner(Variant("gather"), backend=backend, max_num_tokens=16).prefill([[1, 2, 3]])
    assert not backend.reports[0].cut and backend.reports[0].reason == "fast_prefill=False"


def _fails(ctx):
    raise RuntimeError("injected")


def _reduced_region_returns_a_size(ctx):
    """Breaks what the region compile relies on: the reduced region's output becomes a size."""
    reduced = ctx.split.reduced
    output = next(n for n in reduced.graph.nodes if n.op == "output")
    value = output.args[0] if isinstance(output.args[0], torch.fx.Node) else output.args[0][0]
    with reduced.graph.inserting_before(output):
        size = reduced.graph.call_function(torch.ops.aten.sym_size.int, (value, 0))
    size.meta["val"] = value.meta["val"].shape[0]
    output.args = (size,)
    reduced.recompile()


@pytest.mark.parametrize("stage, passes, reason", [
    ("analysis", lambda P: P[:P.index(pipeline.hoist)] + [_fails] + P[P.index(pipeline.hoist):],
     "internal error in pass _fails: RuntimeError: injected"),
    ("cut", lambda P: P[:P.index(pipeline.cut) + 1] + [_fails] + P[P.index(pipeline.cut) + 1:],
     "internal error in pass _fails: RuntimeError: injected"),
    ("region split", lambda P: P + [_fails], "internal error in pass _fails: RuntimeError: injected"),
    ("region compile", lambda P: P + [_reduced_region_returns_a_size], "compiling the cut regions failed: ValueError"),
])
def test_a_failure_at_any_stage_compiles_the_graph_unchanged(stage, passes, reason):
    """The pass never breaks a compile: a failure is counted, its reason reported, and the model
    computes what it computes without the pass."""
    torch.manual_seed(0)
    model = Variant("gather")
    backend = fx_fastprefill.backend(compiler="eager", passes=passes(list(pipeline.PIPELINE)))
    fast = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=16, max_model_len=32)
    ref = fx_fastprefill.Runner(model, max_num_tokens=16, max_model_len=32)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    torch.testing.assert_close(fast.prefill(prompts), ref.prefill(prompts), rtol=1e-4, atol=1e-4)
    [report] = backend.reports
    assert not report.cut and report.reason.startswith(reason), report.reason
    assert backend.fallbacks[fallbacks.PASS_FAILED] == 1 and report.fallbacks[fallbacks.PASS_FAILED] == 1
