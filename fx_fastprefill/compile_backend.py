"""The torch.compile backend: AOT to a functional aten graph, the fast-prefill passes, then Inductor.

``torch.compile(model, backend="fx_fastprefill")`` uses a shared default instance;
``fx_fastprefill.backend(...)`` makes one with options and its own ``reports``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch.fx import GraphModule, Node

from .dynamic_shapes import exact_size_reasoning
from . import fallbacks as fallback_reasons
from .fallbacks import FallbackCounter
from .fast_prefill_module import FastPrefillModule
from .report import AttentionLayerInfo, FastPrefillReport
from .report_builder import clean_name, gathered, hoist_stop, kv_consumers, narrowed_tensor

log = logging.getLogger("fx_fastprefill")

COMPILERS = ("inductor", "eager")


def _decompositions():
    from torch._inductor.decomposition import select_decomp_table
    return select_decomp_table()


def piecewise_cudagraphs_supported() -> bool:
    """Graphs keep non-owning views of their outputs (torch's own CUDA-graph helpers)."""
    from .piecewise_region import non_owning_supported
    return non_owning_supported()


def _inductor(gm: GraphModule, example_inputs: Sequence, static_input_idxs: Sequence[int]):
    """compile_fx_inner on one graph; the parameters (``static_input_idxs``) keep their addresses."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool
    with exact_size_reasoning():
        return compile_fx_inner(gm, list(example_inputs), is_inference=True, cudagraphs=BoxedBool(False),
                                static_input_idxs=list(static_input_idxs))


def _compile_graph(gm: GraphModule, example_inputs: Sequence, compiler: str, static_input_idxs: Sequence[int] = ()):
    """One region or piece as a boxed callable (a list of inputs in, a list of outputs out)."""
    if compiler == "eager":
        def run(args: list) -> list:
            out = gm(*args)
            args.clear()
            return list(out)
        return run
    from torch._guards import TracingContext, detect_fake_mode, tracing
    # Each graph is its own Inductor graph: give it its own tracing context (Inductor records the
    # output strides of one graph per context).
    with tracing(TracingContext(detect_fake_mode(list(example_inputs)))):
        compiled = _inductor(gm, example_inputs, static_input_idxs)

    def run_compiled(args: list) -> list:
        return list(compiled(args))
    return run_compiled


def _compile_region(gm: GraphModule, example_inputs: Sequence, compiler: str, static_input_idxs: Sequence[int] = (),
                    cudagraphs: bool = False, record_fallback: Callable[[str], None] | None = None):
    """A region as one compiled graph, or with ``cudagraphs`` as pieces between the package's ops,
    each compiled alone and recorded per size (fx_fastprefill/piecewise_region.py)."""
    if not cudagraphs:
        return _compile_graph(gm, example_inputs, compiler, static_input_idxs)
    from fx_fastprefill.passes.split_at_attention import Piece, split_at_attention
    from .piecewise_region import PiecewiseRegion
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = {placeholders[i] for i in static_input_idxs} | {n for n in gm.graph.nodes if n.op == "get_attr"}
    steps = split_at_attention(gm)
    compiled = [_compile_graph(step.module, [n.meta["val"] for n in step.inputs], compiler,
                               [i for i, n in enumerate(step.inputs) if n in static])
                if isinstance(step, Piece) else None for step in steps]
    return PiecewiseRegion(gm, steps, compiled, static, record_fallback or (lambda reason: None))


def _static_inputs(placeholders: list[Node]) -> set[Node]:
    """The placeholders AOT marked static (parameters and buffers): same address every call."""
    from torch._guards import TracingContext
    context = TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    indices = getattr(metadata, "static_input_indices", None) or []
    return {placeholders[i] for i in indices if i < len(placeholders)}


class FastPrefillBackend:
    """A torch.compile backend. Keeps one :class:`FastPrefillReport` per compiled graph in ``reports``."""

    def __init__(self, *, fast_prefill: bool = True, draft_layers: Iterable[str] = (), compiler: str = "inductor",
                 prompt_len: int = 2048, cudagraphs: bool = False, narrow_slices: bool = True):
        if not isinstance(fast_prefill, bool):
            raise TypeError(f"fast_prefill must be a bool, got {fast_prefill!r}")
        if isinstance(draft_layers, str) or not all(isinstance(d, str) for d in draft_layers):
            raise TypeError(f"draft_layers must be an iterable of layer names (str), got {draft_layers!r}")
        if compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        if not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len must be a positive int (the prompt length of the FLOPs estimate), got {prompt_len!r}")
        if not isinstance(cudagraphs, bool):
            raise TypeError(f"cudagraphs must be a bool, got {cudagraphs!r}")
        if not isinstance(narrow_slices, bool):
            raise TypeError(f"narrow_slices must be a bool, got {narrow_slices!r}")
        if cudagraphs and compiler != "inductor":
            raise ValueError(f"cudagraphs=True needs compiler='inductor' (the regions are captured by Inductor), got {compiler!r}")
        if cudagraphs and not piecewise_cudagraphs_supported():
            raise RuntimeError(f"cudagraphs=True needs torch._C._construct_storage_from_data_pointer (non-owning "
                               f"views of graph outputs), absent in torch {torch.__version__}")
        self.cudagraphs = cudagraphs
        self.narrow_slices = narrow_slices
        self.fast_prefill = fast_prefill
        self.draft_layers = list(draft_layers)
        self.compiler = compiler
        self.prompt_len = prompt_len
        self.reports: list[FastPrefillReport] = []
        self.fallbacks = FallbackCounter()
        self._input_names: list[str] = []

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any]):
        from fx_fastprefill.passes.capture_sdpa import capture_sdpa
        self._input_names = [clean_name(n.name) for n in gm.graph.nodes if n.op == "placeholder"]
        if self.fast_prefill:
            capture_sdpa(gm)
        return aot_module_simplified(gm, example_inputs, fw_compiler=self._compile_aten,
                                     inference_compiler=self._compile_aten, decompositions=_decompositions())

    # ----------------------------------------------------------------------------------------------

    def _compile_aten(self, gm: GraphModule, example_inputs: Sequence[Any]):
        from fx_fastprefill.passes.attention_nodes import find_attention_nodes
        from fx_fastprefill.passes.cut_graph import CutError, cut_graph
        from fx_fastprefill.passes.eligible_layers import eligible_layers
        from fx_fastprefill.passes.flops import estimate_flops
        from fx_fastprefill.passes.gather_hoisting import NoCut, analyze
        from fx_fastprefill.passes.link_kv_sources import link_kv_sources
        from fx_fastprefill.passes.narrow_sliced_producers import narrow_sliced_producers
        from fx_fastprefill.passes.split_regions import split_regions

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = dict(zip(placeholders, self._input_names)) if len(placeholders) == len(self._input_names) else {}
        layers = link_kv_sources(gm)
        report = FastPrefillReport(
            cut=False,
            attention_layers=[AttentionLayerInfo(a.layer, a.kv_source, a.sliding_window, a.masked) for a in layers],
            eligible_layers=eligible_layers(layers, self.draft_layers, self.fast_prefill),
            draft_layers=[a.layer for a in layers if a.layer in self.draft_layers],
            prompt_len=self.prompt_len,
            placeholder_names={n: names.get(n, n.name) for n in placeholders},
        )
        self.reports.append(report)
        static = _static_inputs(placeholders)
        cudagraphs = self.cudagraphs
        if cudagraphs and not any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs):
            cudagraphs = False
            self.fallbacks.record(fallback_reasons.CUDAGRAPHS_NOT_CUDA)
            report.fallbacks[fallback_reasons.CUDAGRAPHS_NOT_CUDA] += 1
        report.cudagraphs = cudagraphs
        if not self.fast_prefill:
            report.reason = "fast_prefill=False"
            return self._compile_unchanged(gm, example_inputs, report, static, cudagraphs)
        if not layers:
            report.reason = "the graph has no attention the pass knows (fx_fastprefill.attention, or SDPA in a transformers model)"
        original, (gm, copies) = gm, _copy_graph_module(gm)  # the cut works on a copy: a failed cut leaves nothing half-done
        report.placeholder_names.update({copies[n]: name for n, name in list(report.placeholder_names.items())})
        try:
            plan = analyze(gm)
        except NoCut as e:
            report.reason = str(e) if not report.reason else report.reason + "; " + str(e)
            return self._compile_unchanged(original, example_inputs, report, static, cudagraphs)
        report.flops_full = estimate_flops(gm, plan.rows, plan.reduced_rows, self.prompt_len)
        narrowed = narrow_sliced_producers(gm, plan) if self.narrow_slices else []
        if narrowed:
            plan = analyze(gm)  # the reduced slices' producers can now join the reduced region
        feeds_kv = kv_consumers(gm)
        report.stops = [hoist_stop(stop, report, feeds_kv) for stop in plan.stops]
        if not plan.reduced_attention:
            first = report.stops[0] if report.stops else None
            hint = (" (hidden states or attentions asked for as outputs keep every row)"
                    if first is not None and first.reason == "a graph output" else "")
            report.reason = report.reason or ("the hoist stopped before any attention layer" +
                                              (f": {first.tensor} ({first.op}): {first.reason}" if first else "") + hint)
            return self._compile_unchanged(original, example_inputs, report, static, cudagraphs)
        try:
            cut_graph(gm, plan)
        except CutError as e:
            report.reason = f"the cut could not be applied: {e}"
            return self._compile_unchanged(original, example_inputs, report, static, cudagraphs)
        stages = split_regions(gm)
        static_copies = {copies[n] for n in static}
        record_fallback = self._fallback_recorder(report)
        compiled = {name: _compile_region(stage.module, [n.meta["val"] for n in stage.inputs], self.compiler,
                                          [i for i, n in enumerate(stage.inputs) if n in static_copies], cudagraphs,
                                          record_fallback)
                    for name, stage in stages.items() if stage.module is not None}
        module = FastPrefillModule(gm, stages, compiled, plan.index, plan.rows, plan.reduced_rows, record_fallback,
                                   suffix=plan.suffix is not None, copy_outputs=cudagraphs)
        reduced_attention = set(plan.reduced_attention)
        report.rows_symbol, report.reduced_rows_symbol = plan.rows, plan.reduced_rows
        report.cut = True
        report.row_selection = ("rows by logits_indices" if plan.suffix is None else
                                f"the last {plan.suffix} row{'s' if plan.suffix > 1 else ''} of each sequence (logits_to_keep)")
        report.reduced_layers = [a.layer for a in find_attention_nodes(gm.graph) if a.node in reduced_attention]
        report.gathered = [gathered(node, report) for node in stages["boundary"].nodes if "ffp_source" in node.meta]
        report.narrowed = [narrowed_tensor(split, report) for split in narrowed]
        report.flops_cut = estimate_flops(gm, plan.rows, plan.reduced_rows, self.prompt_len)
        report.flops_removed_fraction = 1.0 - report.flops_cut / report.flops_full if report.flops_full else 0.0
        report.graph = gm
        log.info("compiled a graph with %d attention layers\n%s", len(layers), report.summary())
        return module

    def _compile_unchanged(self, gm: GraphModule, example_inputs, report: FastPrefillReport, static: set[Node],
                           cudagraphs: bool):
        report.graph = gm
        log.info("graph left unchanged: %s", report.reason)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if self.compiler == "eager":
            return gm
        static_idxs = [i for i, n in enumerate(placeholders) if n in static]
        if cudagraphs:
            region = _compile_region(gm, example_inputs, self.compiler, static_idxs, True, self._fallback_recorder(report))
            region.copy_outputs = True  # the caller keeps them past the next call
            return region
        return _inductor(gm, example_inputs, static_idxs)

    def _fallback_recorder(self, report: FastPrefillReport) -> Callable[[str], None]:
        """Counts a run-time fallback on the backend (which logs it) and on the graph's report."""
        def record(reason: str) -> None:
            self.fallbacks.record(reason)
            report.fallbacks[reason] += 1
        return record


def _copy_graph_module(gm: GraphModule) -> tuple[GraphModule, dict[Node, Node]]:
    """A new graph of the same nodes, and the map from old to new nodes (meta dicts are copied
    shallowly: fake values are shared, not cloned)."""
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    return GraphModule(gm, graph), env


def backend(*, fast_prefill: bool = True, draft_layers: Iterable[str] = (), **options: Any) -> FastPrefillBackend:
    """A configured backend for ``torch.compile(model, backend=fx_fastprefill.backend(...))``.

    Options: ``compiler`` ("inductor" or "eager": run the cut regions without Inductor),
    ``prompt_len`` (prompt length of the report's FLOPs estimate, default 2048), ``cudagraphs``
    (piecewise CUDA graphs: the code between attention ops captured per size, on CUDA) and
    ``narrow_slices`` (default True; False skips passes/narrow_sliced_producers.py, to measure or
    bisect it).
    """
    known = ("compiler", "prompt_len", "cudagraphs", "narrow_slices")
    unknown = set(options) - set(known)
    if unknown:
        raise TypeError(f"fx_fastprefill.backend() got unknown options {sorted(unknown)}; known: {', '.join(known)}")
    return FastPrefillBackend(fast_prefill=fast_prefill, draft_layers=draft_layers, **options)


default_backend = FastPrefillBackend()


def fx_fastprefill_backend(gm: GraphModule, example_inputs: Sequence[Any]):
    """Entry point for ``torch.compile(model, backend="fx_fastprefill")``; reports go to ``default_backend``."""
    return default_backend(gm, example_inputs)
