"""Every private torch name the package uses, in one place: the seams a torch release can move.

The rest of ``fx_fastprefill/`` reaches torch's internals only through this module
(tests/test_torch_seams.py fails on a private torch name used anywhere else, and on a seam that no
longer resolves). Each seam says what it is for; all were checked on torch 2.11 (the GPU machine),
2.13.0 and 2.14.1 (CPU). A seam that exists only in some releases says so and how its absence is
handled. Public APIs are used wherever one serves (``torch.compiler``, ``torch.fx``,
``torch.fx.experimental.symbolic_shapes``); what is here has none.

Imports are lazy where the module is heavy or optional (Dynamo's precompile, Inductor's code cache,
torch.distributed), so importing the package stays cheap.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Callable, Iterator, Sequence

import torch
import torch._functorch.config as functorch_config  # noqa: F401  AOTAutograd's cache switches
import torch.fx.experimental._config as fx_config  # noqa: F401  duck shaping, size-oblivious reasoning
from torch._guards import TracingContext  # what AOTAutograd and Inductor share about the graph being compiled


def __getattr__(name: str) -> Any:
    """The seams that load Dynamo or Inductor, imported at first use: the passes, which read only
    op schemas, load neither."""
    if name == "dynamo_config":  # Dynamo's trace-time settings (specialize_float, ...)
        import torch._dynamo.config as dynamo_config
        return dynamo_config
    if name == "inductor_config":  # Inductor's codegen and cache settings
        import torch._inductor.config as inductor_config
        return inductor_config
    if name == "aot_module_simplified":  # the backend's one AOT trace
        from torch._functorch.aot_autograd import aot_module_simplified
        return aot_module_simplified
    if name == "CustomGraphPass":  # a post-grad pass Inductor's FX graph cache keys
        from torch._inductor.custom_graph_pass import CustomGraphPass
        return CustomGraphPass
    if name == "SerializableAOTDispatchCompiler":  # a compiler whose output AOTAutograd caches (2.11+)
        from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
        return SerializableAOTDispatchCompiler
    if name == "OutputCode":  # the base of what such a compiler returns
        from torch._inductor.output_code import OutputCode
        return OutputCode
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- Dynamo ----------------------------------------------------------------------------------

def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """A dim Dynamo should trace as a symbol unless it must specialize it."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def graphs_compiled() -> int:
    """Dynamo's count of graphs compiled in this process (any backend)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def aot_compile_available() -> bool:
    """Dynamo's ahead-of-time compile (``torch.compile(...).aot_compile``), 2.11+."""
    return importlib.util.find_spec("torch._dynamo.aot_compile") is not None


def serializable_backend_result(compiled: Any) -> Any:
    """A backend's AOTAutograd-compiled function wrapped so that aot_compile can save it: 2.13+
    wraps it itself (the function is then returned as it is), 2.11 only for Inductor. Wrapped
    already: its class has the serializable-callable protocol (the wrapper forwards attribute reads
    to what it wraps, so the class is asked, not the object)."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    wrapped = callable(getattr(type(compiled), "serialize_compile_artifacts", None))
    if getattr(compiled, "serialize", None) is not None and not wrapped:
        return BundledAOTAutogradSerializableCallable(compiled)
    return compiled


def unsupported_serialization_guard_types() -> set[str]:
    """The guard types Dynamo cannot save with a precompiled function."""
    from torch._dynamo.guards import CheckFunctionManager
    return set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)


@contextlib.contextmanager
def guards_pickled_within(changed: Callable[[Any], contextlib.AbstractContextManager]) -> Any:
    """Within: Dynamo pickles a precompiled function's guard state inside ``changed(state)`` (a
    context that alters the state and puts it back)."""
    from torch._dynamo import guards
    original = guards.pickle_guards_state

    def pickle_state(state: Any, builder: Any) -> bytes:
        with changed(state):
            return original(state, builder)
    guards.pickle_guards_state = pickle_state
    try:
        yield
    finally:
        guards.pickle_guards_state = original


# --- Inductor --------------------------------------------------------------------------------

def compile_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Inductor's whole compile (AOT included): a graph left unchanged, with autograd on."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile
    return inductor_compile(gm, list(example_inputs))


def compile_fx_inner(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
    """Inductor's compile of one aten graph (after AOT): a region or a piece."""
    from torch._inductor.compile_fx import compile_fx_inner as inner
    return inner(gm, example_inputs, **kwargs)


def inductor_decompositions() -> dict:
    """The decompositions Inductor gives AOTAutograd (its lowerings cover the rest)."""
    from torch._inductor.decomposition import select_decomp_table
    return select_decomp_table()


def warm_compile_workers() -> None:
    """Start Inductor's Triton compile workers (what Dynamo's ``inductor`` backend does first).
    Kept, measured: without it a cold Runner start at Gemma 3n E2B shapes took 62.7 and 73.1 s
    against 53.1 and 55.7 s with it, warm starts equal (H100, BENCHMARKS.md section 8)."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # pragma: no cover - an optimisation only
        return
    maybe_warm_pool()


def mode_options(mode: str, dynamic: bool | None) -> dict[str, Any]:
    """Inductor's options for a ``torch.compile`` mode ("reduce-overhead", ...), as a dict that a
    call can extend (``torch.compile`` takes a mode or options, not both)."""
    return torch._inductor.list_mode_options(mode, dynamic)


def reload_compiled_graph(graph: Any) -> Any:
    """A deserialized ``CompiledFxGraph`` made callable again: its source written back to Inductor's
    code cache and loaded, what Inductor does on an FX-graph-cache hit (its output strides not
    reported to the enclosing compile). None where Inductor could not load it."""
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.output_code import CompiledFxGraphConstants
    constants = CompiledFxGraphConstants()
    loaded, _ = FxGraphCache.cache_hit_post_compile(graph, {}, constants)
    if loaded is None:
        return None
    with output_strides_unreported():
        loaded.post_compile([], constants, {"cudagraphs": False, "is_backward": False})
    return loaded


@contextlib.contextmanager
def output_strides_unreported() -> Iterator[None]:
    """Within: Inductor reports no graph's output strides to the enclosing compile. AOTAutograd
    restrides the outputs of the graph it compiles by what Inductor reports to its tracing context,
    and a region or piece compiled inside the backend is not that graph (nor a graph reloaded
    from a saved program, whose strides name symbols of the shape environment it was compiled in)."""
    context = TracingContext.try_get()
    if context is None:
        yield
        return
    reported = context.output_strides
    context.output_strides = None  # Inductor reports only to a list (set by AOT around its compile)
    try:
        yield
    finally:
        context.output_strides = reported


@contextlib.contextmanager
def launched_kernels_picklable(graph: Any) -> Iterator[None]:
    """Within: the statically launched Triton kernels a ``CompiledFxGraph`` bundles pickle, though
    they have launchers. On an FX-graph-cache hit Inductor registers the bundle's own kernels as the
    ones the loaded code runs, and loading makes their launchers, so such a graph no longer pickles
    ("pickle should not be called after make_launchers()"). The kernels' own
    ``prepare_for_pickle`` / ``restore_after_unpickle`` pair (what Inductor's bundler calls to save
    a kernel that has run) drops the launchers for the pickle and puts them back after; the
    kernel's ``_reload_kernel`` closure likewise."""
    bundle = getattr(graph, "_triton_bundle", None)
    kernels = [entry.kernel for entry in getattr(bundle, "static_autotuners", None) or ()
               if getattr(entry.kernel, "launchers", None) or getattr(entry.kernel, "_reload_kernel", None)]
    saved: list[tuple[Any, Any]] = []
    try:
        for kernel in kernels:
            # and the closure a loaded kernel reloads itself with (Inductor's saved copies have None)
            saved.append((kernel.prepare_for_pickle(), getattr(kernel, "_reload_kernel", None)))
            kernel._reload_kernel = None
        yield
    finally:
        for kernel, (old_values, reload_kernel) in zip(kernels, saved):
            kernel.restore_after_unpickle(old_values)
            kernel._reload_kernel = reload_kernel


def static_input_indices() -> list[int]:
    """The inputs AOTAutograd marked static (parameters, buffers) in the graph it is compiling."""
    context = TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    return list(getattr(metadata, "static_input_indices", None) or [])


# --- fake tensors, dispatch modes, ops ---------------------------------------------------------

def fake_tensor_mode(**kwargs: Any) -> Any:
    """A fresh FakeTensorMode (a forward run for shapes only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(**kwargs)


def no_dispatch_modes() -> contextlib.AbstractContextManager:
    """No dispatch mode (fake, proxy) within: real tensors and real objects."""
    return torch.utils._python_dispatch._disable_current_modes()


def flash_attention_forward(*args: Any, **kwargs: Any) -> Any:
    """FlashAttention's varlen forward (packed sequences, no padding)."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


# --- torch.distributed -----------------------------------------------------------------------

def process_group_named(name: str) -> Any:
    """The process group a functional collective names (graphs carry groups by name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


# --- logging ---------------------------------------------------------------------------------

def structured_trace_on() -> bool:
    """Torch's structured trace writes (``TORCH_TRACE=DIR``, or a handler of the user's): torch's own
    handler is always installed, and writes only once given a folder."""
    from torch._logging import _internal
    return any(getattr(h, "root_dir", True) is not None for h in _internal.trace_log.handlers)


def trace_artifact(name: str, text: str) -> None:
    """``text`` as an artifact of torch's structured trace: tlparse shows it under the compile it
    belongs to, beside Dynamo's and Inductor's graphs."""
    from torch._logging import _internal
    _internal.trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"},
                               payload_fn=lambda: text)


def register_torch_log(name: str, enable_now: bool) -> None:
    """``TORCH_LOGS=name`` turns the logger ``name`` on (``enable_now``: re-read TORCH_LOGS)."""
    from torch._logging import _internal
    _internal.register_log(name, name)
    if enable_now:
        _internal._init_logs()
