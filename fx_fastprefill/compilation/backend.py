"""The torch.compile backend: AOT to a functional aten graph, the pass pipeline, then the regions
compiled and put behind the per-step gate.

``torch.compile(model, backend="fx_fastprefill")`` uses a shared default instance;
``fx_fastprefill.backend(...)`` makes one with options and its own ``reports``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.fx import GraphModule, Node

from fx_fastprefill.ops.schema import SDPA_OP, is_package_op
from fx_fastprefill.passes.capture_sdpa import capture_sdpa
from fx_fastprefill.passes.fx_utils import input_name, placeholders
from fx_fastprefill.passes.pipeline import (DUMP_ENV, PIPELINE, Pass, PassContext, PipelineOptions, run_pipeline,
                                             unchanged_pieces)
from fx_fastprefill.passes.split_regions import FULL, REDUCED

from .. import fallbacks as fallback_reasons
from .. import torch_seams
from ..fallbacks import FallbackCounter
from ..ops import attention as _attention_kernels  # noqa: F401  (the ops' kernels, registered)
from ..ops import sdpa as _sdpa_kernels  # noqa: F401
from ..ops.attention import NO_BACKWARD
from ..report.builder import build_report
from ..report.report import ReportLog
from . import damaged_files, program_cache, program_env, spmd
from .compile_graph import (COMPILERS, GraphCode, Submodule, compile_boxed, lowering,
                            swap_submodule)
from .cudagraphs import PiecewiseRegion, non_owning_supported, recording_refusal
from .program_cache import ProgramCode
from .program_env import GraphKeys, ProgramEnv
from .regions import CompiledProgram, StepGate

log = logging.getLogger("fx_fastprefill")

AUTOGRAD_REASON = (
    "autograd is on (grad mode enabled and parameters or inputs require grad): the graph is compiled the standard "
    "way, uncut, so that gradients are right; call the model under torch.no_grad() or torch.inference_mode() "
    "for the cut"
)


def _static_inputs(inputs: list[Node]) -> set[Node]:
    """The placeholders AOT marked static (parameters and buffers): same address every call."""
    return {inputs[i] for i in torch_seams.static_input_indices() if i < len(inputs)}


def needs_autograd(gm: GraphModule, example_inputs: Sequence[Any]) -> bool:
    """AOTAutograd's own test: grad mode on and an input (parameters included) that requires grad."""
    if not torch.is_grad_enabled():
        return False
    inputs = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return any(t.requires_grad for t in [*inputs, *gm.parameters()])


class FastPrefillBackend:
    """A torch.compile backend. Keeps a :class:`FastPrefillReport` per compiled graph in ``reports``
    (the latest ``max_reports``). A graph on non-CUDA inputs is compiled for CUDA graphs only
    where a recorder is set (``program_env.recording_with``: tests' stand-in on the CPU)."""

    def __init__(self, *, fast_prefill: bool = True, draft_layers: Iterable[str] = (), compiler: str = "inductor",
                 prompt_len: int = 2048, cudagraphs: bool = False, narrow_slices: bool = True,
                 max_reports: int = 64, passes: Sequence[Pass] | None = None, small_contractions: bool = True):
        if not isinstance(fast_prefill, bool):
            raise TypeError(f"fast_prefill must be a bool, got {fast_prefill!r}")
        if isinstance(draft_layers, str) or not all(isinstance(d, str) for d in draft_layers):
            raise TypeError(f"draft_layers must be an iterable of layer names (str), got {draft_layers!r}")
        if compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        if not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(
                f"prompt_len must be a positive int (the prompt length of the FLOPs estimate), got {prompt_len!r}"
            )
        if not isinstance(cudagraphs, bool):
            raise TypeError(f"cudagraphs must be a bool, got {cudagraphs!r}")
        if not isinstance(narrow_slices, bool):
            raise TypeError(f"narrow_slices must be a bool, got {narrow_slices!r}")
        if not isinstance(small_contractions, bool):
            raise TypeError(f"small_contractions must be a bool, got {small_contractions!r}")
        if not isinstance(max_reports, int) or max_reports < 1:
            raise ValueError(f"max_reports must be a positive int, got {max_reports!r}")
        if cudagraphs and not non_owning_supported():
            raise RuntimeError("cudagraphs=True needs non-owning CUDA views of graph outputs, which torch.as_tensor "
                               "makes through numpy: pip install numpy")
        self.cudagraphs = cudagraphs
        self.compiler = compiler
        self.small_contractions = small_contractions
        self.options = PipelineOptions(fast_prefill, tuple(draft_layers), narrow_slices, prompt_len)
        self.passes = list(PIPELINE if passes is None else passes)
        if not all(callable(p) for p in self.passes):
            raise TypeError(f"passes must be callables taking a PassContext, got {self.passes!r}")
        self.reports = ReportLog(max_reports)
        self.fallbacks = FallbackCounter()
        self._input_names: list[str] = []
        self._autograd_warned = False
        self._declined_by_ranks = ""  # set while the ranks' disagreement recompiles a graph unchanged
        options = {**dataclasses.asdict(self.options), "compiler": compiler, "cudagraphs": cudagraphs,
                   "small_contractions": small_contractions}
        # What keys this backend's programs in a cache (program_cache.py); None: not cacheable.
        self.cache_tag = program_cache.cache_key_tag(options, self.passes)

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any]):
        if self.compiler == "inductor":
            torch_seams.warm_compile_workers()
        self._input_names = [input_name(n.name) for n in placeholders(gm)]
        if needs_autograd(gm, example_inputs):
            return self._compile_for_autograd(gm, example_inputs)
        if self.options.fast_prefill:
            capture_sdpa(gm)
        compiled, code = self._aot(gm, example_inputs)
        if code is None or not code.groups:
            return compiled
        # Tensor parallel: the ranks compare plans only now, whether each compiled or loaded its
        # program (compilation/spmd.py); on a difference every rank compiles the graph unchanged.
        ranks, disagreement = spmd.check(code.groups, code.fingerprint)
        code.report.ranks = ranks
        if disagreement and code.fingerprint == spmd.UNCHANGED:  # this rank's program is unchanged already
            code.report.reason = disagreement
            self._fallback_recorder(code.report.fallbacks)(fallback_reasons.RANKS_DISAGREE)
        elif disagreement:
            self._declined_by_ranks = disagreement
            try:
                with torch_seams.functorch_config.patch(enable_autograd_cache=False):  # not the cut just saved
                    compiled, code = self._aot(gm, example_inputs)
            finally:
                self._declined_by_ranks = ""
            code.report.ranks = ranks
        return compiled

    def _aot(self, gm: GraphModule, example_inputs: Sequence[Any]) -> tuple[Callable[..., Any], ProgramCode | None]:
        """AOTAutograd with the pipeline as its compiler, through its cache: the program compiled,
        or loaded from the cache (program_cache.py), with it the ProgramCode it ran."""
        programs: list[ProgramCode] = []
        users_tag = torch.compiler.config.cache_key_tag

        dumping = bool(os.environ.get(DUMP_ENV))  # dumping the passes' graphs: they must run, not load
        saving = program_cache.can_save() and self.cache_tag is not None and not dumping
        if not saving and not dumping:
            self.fallbacks.record(fallback_reasons.NO_PROGRAM_CACHE)

        def compile_program(aten: GraphModule, inputs: Sequence[Any]) -> ProgramCode:
            with program_cache.compiling_regions(users_tag), \
                    lowering(small_contractions=self.small_contractions, saving=saving):
                programs.append(self._compile_aten(aten, inputs))
            return programs[-1]

        def loaded(code: ProgramCode) -> None:
            self.adopt_loaded(code)
            programs.append(code)

        caching = program_cache.caching(self.cache_tag, loaded) if saving else contextlib.nullcontext()
        compiler = program_cache.serializable(compile_program) if saving else compile_program
        with caching, damaged_files.counted_by(self.fallbacks.record):
            compiled = torch_seams.aot_module_simplified(gm, example_inputs, fw_compiler=compiler,
                                                         inference_compiler=compiler,
                                                         decompositions=torch_seams.inductor_decompositions())
        return compiled, (programs[-1] if programs else None)

    def adopt_loaded(self, code: ProgramCode) -> None:
        """A program from the cache joins this backend: its report, its compile-time fallbacks counted
        again, its run-time ones counted here from now on."""
        report = code.report
        report.from_cache = True
        for reason, count in report.fallbacks.items():
            self.fallbacks.record(reason)
            self.fallbacks[reason] += count - 1
        code.env = ProgramEnv(self._fallback_recorder(report.fallbacks))
        self.reports.append(report)
        log.info("loaded a compiled graph from the AOTAutograd cache%s", "" if report.cut else " (not cut)")

    def _compile_for_autograd(self, gm: GraphModule, example_inputs: Sequence[Any]):
        """A graph that autograd differentiates is compiled the standard way, with no package op in
        it: the cut's reduced region and its saved activations would not match the backward graph."""
        if any(is_package_op(n) and n.target is not SDPA_OP for n in gm.graph.nodes):
            raise RuntimeError(NO_BACKWARD)
        graph_fallbacks = FallbackCounter()
        self._fallback_recorder(graph_fallbacks)(fallback_reasons.AUTOGRAD)
        ctx = PassContext(gm, self.options, unchanged=gm, declined=AUTOGRAD_REASON)
        names = dict(zip(placeholders(gm), self._input_names))
        self.reports.append(build_report(ctx, names, False, graph_fallbacks))
        # Inference left with grad on loses the cut: said once per backend at WARNING, then at INFO.
        log.log(logging.INFO if self._autograd_warned else logging.WARNING, "graph left unchanged: %s",
                AUTOGRAD_REASON)
        self._autograd_warned = True
        if self.compiler == "eager":
            return gm
        return torch_seams.compile_fx(gm, example_inputs)

    def _compile_aten(self, gm: GraphModule, example_inputs: Sequence[Any]) -> ProgramCode:
        inputs = placeholders(gm)
        names = dict(zip(inputs, self._input_names)) if len(inputs) == len(self._input_names) else {}
        static = _static_inputs(inputs)
        graph_fallbacks = FallbackCounter()  # this graph's share of self.fallbacks, in its report
        record_fallback = self._fallback_recorder(graph_fallbacks)
        cudagraphs = self.cudagraphs and self._graphs_recordable(example_inputs, record_fallback)
        ctx = run_pipeline(PassContext(gm, dataclasses.replace(self.options, cudagraphs=cudagraphs),
                                       static_inputs=static), self.passes)
        if self._declined_by_ranks:
            ctx.declined = self._declined_by_ranks
            record_fallback(fallback_reasons.RANKS_DISAGREE)
        program = None
        if not ctx.declined:
            try:
                program = self._compile_cut(ctx, static, cudagraphs)
            except Exception as e:  # noqa: BLE001 - the pass never breaks a compile: counted, logged, unchanged
                log.warning("compiling the cut regions failed; the graph is compiled unchanged", exc_info=True)
                ctx.declined, ctx.failed = f"compiling the cut regions failed: {type(e).__name__}: {e}", True
        if ctx.failed:
            record_fallback(fallback_reasons.PASS_FAILED)
        report = build_report(ctx, names, cudagraphs, graph_fallbacks)
        self.reports.append(report)
        if ctx.declined:
            log.info("graph left unchanged: %s", report.reason)
            program = self._compile_unchanged(ctx.unchanged or gm, example_inputs, static,
                                              unchanged_pieces(ctx) if cudagraphs else None)
        else:
            log.info("compiled a graph with %d attention layers\n%s", len(ctx.layers), report.summary())
        groups = spmd.collective_groups(ctx.unchanged or gm)
        keys = GraphKeys.NONE if not cudagraphs else GraphKeys.TOGETHER if ctx.declined else GraphKeys.APART
        fingerprint = spmd.fingerprint(ctx.gm, ctx.declined, ctx.regions)
        return ProgramCode(program, report, groups, fingerprint, record_fallback, keys)

    def _graphs_recordable(self, example_inputs: Sequence[Any], record_fallback: Callable[[str], None]) -> bool:
        """CUDA graphs for this graph, where cudagraphs.recording_refusal allows them; else counted,
        and none are made."""
        on_cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
        refusal = recording_refusal(self.compiler, on_cuda, program_env.recorder())
        if refusal is not None:
            record_fallback(refusal)
        return refusal is None

    def _compile_cut(self, ctx: PassContext, static: set[Node], cudagraphs: bool) -> CompiledProgram:
        """The two regions compiled and swapped into the split graph, the reduced one behind the gate."""
        split, plan = ctx.split, ctx.plan
        compiled_pieces: dict = {}  # one compile per distinct piece, shared by both regions (one shape env)
        for name in (FULL, REDUCED):
            region = getattr(split, name)
            run = self._compile_region(region, ctx.region_static_idxs[name], cudagraphs, ctx.pieces.get(name),
                                       compiled_pieces)
            if name == REDUCED and plan.per_step:
                run = StepGate(run, region, plan.index.name, plan.rows, plan.reduced_rows)
            swap_submodule(split, name, run)
        return CompiledProgram(GraphCode(split), copy_outputs=cudagraphs)

    def _compile_region(self, region: GraphModule, static_idxs: list[int], cudagraphs: bool, pieces: Any = None,
                        compiled_pieces: dict | None = None) -> Callable[..., Any]:
        if cudagraphs:
            return PiecewiseRegion(region, self.compiler, static_idxs, pieces, compiled_pieces)
        return Submodule(compile_boxed(region, self.compiler, static_idxs))

    def _compile_unchanged(self, gm: GraphModule, example_inputs: Sequence[Any], static: set[Node],
                           pieces: tuple[GraphModule, list] | None) -> CompiledProgram:
        """``gm`` as it is; with CUDA graphs (``pieces``: the pipeline's split of it), piecewise."""
        static_idxs = [i for i, n in enumerate(placeholders(gm)) if n in static]
        if pieces is not None:
            region = PiecewiseRegion(gm, self.compiler, static_idxs, pieces)
            region.copy_outputs = True  # the caller keeps them past the next call
            return CompiledProgram(region)
        return CompiledProgram(Submodule(compile_boxed(gm, self.compiler, static_idxs, example_inputs)))

    def _fallback_recorder(self, graph_fallbacks: FallbackCounter) -> Callable[[str], None]:
        """Counts a fallback on the backend (which logs it) and on the graph's own counter (its report's)."""
        def record(reason: str) -> None:
            self.fallbacks.record(reason)
            graph_fallbacks[reason] += 1
        return record


def backend(*, fast_prefill: bool = True, draft_layers: Iterable[str] = (), **options: Any) -> FastPrefillBackend:
    """A configured backend for ``torch.compile(model, backend=fx_fastprefill.backend(...))``.

    Options: ``compiler`` ("inductor" or "eager": run the cut regions without Inductor),
    ``prompt_len`` (prompt length of the report's FLOPs estimate, default 2048), ``cudagraphs``
    (piecewise CUDA graphs: the code between attention ops captured per size, on CUDA),
    ``narrow_slices`` (default True; False skips passes/narrow_sliced_producers.py, to measure or
    bisect it), ``small_contractions`` (default True: matrix products over at most 8 elements, such
    as AltUp's stream mix, lowered as multiply-sums Inductor fuses, not as GEMM calls;
    passes/small_contractions.py), ``max_reports`` (reports kept, default 64) and ``passes`` (the
    pass pipeline, default ``fx_fastprefill.passes.pipeline.PIPELINE``: a list to insert a pass of
    your own).
    """
    known = ("compiler", "prompt_len", "cudagraphs", "narrow_slices", "small_contractions", "max_reports", "passes")
    unknown = set(options) - set(known)
    if unknown:
        raise TypeError(f"fx_fastprefill.backend() got unknown options {sorted(unknown)}; known: {', '.join(known)}")
    return FastPrefillBackend(fast_prefill=fast_prefill, draft_layers=draft_layers, **options)


default_backend = FastPrefillBackend()


def fx_fastprefill_backend(gm: GraphModule, example_inputs: Sequence[Any]):
    """Entry point for ``torch.compile(model, backend="fx_fastprefill")``; reports go to ``default_backend``."""
    return default_backend(gm, example_inputs)
