"""One graph (a region or a piece) compiled on its own, called the way its GraphModule is called.

``split_module`` makes the regions and pieces submodules that take their inputs positionally and
return one value or a tuple; the compiled callable swapped in for a submodule keeps that
convention, so the calling graph's code is the same whether a submodule is compiled or not.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import pickle
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.fx import GraphModule

from fx_fastprefill.passes.small_contractions import rewrite_small_contractions

from .. import torch_seams
from .damaged_files import dropping_damaged_files
from .dynamic_shapes import exact_size_reasoning
from .importable import reference_to, resolve

log = logging.getLogger("fx_fastprefill")

BoxedFn = Callable[[list], list]
COMPILERS = ("inductor", "eager")
# Whether the graphs compiled now have their small contractions rewritten (the backend's
# ``small_contractions`` option) and are kept in their saved form too (the program will be saved):
# set while the backend compiles a program, see :func:`lowering`.
_SMALL_CONTRACTIONS: ContextVar[bool] = ContextVar("fx_fastprefill_small_contractions", default=True)
_SAVING: ContextVar[bool] = ContextVar("fx_fastprefill_saving", default=True)


@contextlib.contextmanager
def lowering(*, small_contractions: bool, saving: bool = True) -> Iterator[None]:
    """Within: the graphs handed to Inductor are lowered with these choices; with ``saving``, each
    compiled graph is pickled as it is compiled (:class:`BoxedGraph`)."""
    tokens = _SMALL_CONTRACTIONS.set(small_contractions), _SAVING.set(saving)
    try:
        yield
    finally:
        _SAVING.reset(tokens[1])
        _SMALL_CONTRACTIONS.reset(tokens[0])


def inductor(gm: GraphModule, example_inputs: Sequence, static_input_idxs: Sequence[int]) -> BoxedFn:
    """``compile_fx_inner`` on one graph that returns a tuple, inside the enclosing compile's tracing
    context (its fake mode and shape environment, which Inductor's FX graph cache keys and guards
    with) but with its output strides kept out of that context's; parameters
    (``static_input_idxs``) keep their addresses."""
    if _SMALL_CONTRACTIONS.get():
        gm, count = rewrite_small_contractions(gm)
        if count:
            log.debug("%d small contractions of a graph computed as fused multiply-sums", count)
    # Inductor's own CUDA graphs off (the package records its own): it boxes the config's setting.
    def compile_graph() -> Any:
        with torch_seams.output_strides_unreported(), exact_size_reasoning(), \
                torch_seams.inductor_config.patch({"triton.cudagraphs": False}):
            return torch_seams.compile_fx_inner(gm, list(example_inputs), is_inference=True,
                                                static_input_idxs=list(static_input_idxs))
    return dropping_damaged_files(compile_graph, "compiling a graph")


def returns_tuple(gm: GraphModule) -> bool:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(out.args[0], (tuple, list))


def _with_tuple_output(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` that returns its one value as a 1-tuple (what Inductor compiles); ``gm``
    itself is left as it is."""
    graph = torch.fx.Graph()
    graph.output((graph.graph_copy(gm.graph, {}),))
    return GraphModule(gm, graph)


def example_inputs(gm: GraphModule) -> list[Any]:
    """The fake values of a graph's inputs (split_module copies them onto the placeholders)."""
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


class GraphCode:
    """A GraphModule's generated code run on the values it reads (the callables swapped in for its
    submodules, its constants): how a compiled program holds its split graphs. It pickles as that
    code, with the globals the code reads named by how to import them, and loads by running the
    code, not by the re-trace a GraphModule unpickles with (which would call the compiled
    callables with proxies)."""

    def __init__(self, gm: GraphModule):
        python_code = gm.graph.python_code(root_module="self")
        targets = {n.target.split(".")[0] for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
        self.__dict__.update({t: getattr(gm, t) for t in targets})
        self._source = python_code.src
        self._globals = dict(python_code.globals)
        self._forward = _compiled_forward(self._source, self._globals)

    def __call__(self, *args: Any) -> Any:
        return self._forward(self, *args)

    def __getstate__(self) -> dict:
        references = {name: reference_to(value) for name, value in self._globals.items()}
        missing = sorted(name for name, reference in references.items() if reference is None)
        if missing:
            raise TypeError(f"a split graph's code reads globals that cannot be imported by name: {missing}")
        state = {k: v for k, v in self.__dict__.items() if k not in ("_forward", "_globals")}
        return {**state, "_globals": references}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._globals = {name: resolve(reference) for name, reference in state["_globals"].items()}
        self._forward = _compiled_forward(self._source, self._globals)


def _compiled_forward(source: str, global_values: dict[str, Any]) -> Callable[..., Any]:
    """The ``forward`` that FX's generated ``source`` defines, run against ``global_values``."""
    namespace = dict(global_values)
    exec(compile(source, "<fx_fastprefill split graph>", "exec", dont_inherit=True), namespace)
    return namespace["forward"]


class BoxedGraph:
    """One compiled graph as a boxed callable (a list of inputs in, cleared; a list of outputs out)
    that pickles: an Inductor ``CompiledFxGraph`` is stored the way the AOTAutograd cache bundles
    one (its generated source, its Triton kernels) and reloaded from that; an aten graph (the
    ``eager`` compiler) is stored as its code.

    The Inductor graph is pickled when it is compiled, not when the program is saved, and its
    bundled Triton kernels are pickled without their launchers
    (:func:`torch_seams.launched_kernels_picklable`): on an FX-graph-cache hit they are the very
    kernels the loaded code runs, and a kernel with launchers does not pickle ("pickle should not be
    called after make_launchers()", seen on the H100 for Gemma 4 E2B's second graph)."""

    def __init__(self, code: Any, single: bool, saved: bytes | str | None = None):
        self.code = code      # a CompiledFxGraph, or a GraphCode under compiler="eager"
        self.single = single  # the graph returns one value (Inductor was given it as a 1-tuple)
        self.saved = saved    # the CompiledFxGraph pickled as compiled, or why it did not pickle

    def __call__(self, args: list) -> list:
        if isinstance(self.code, GraphCode):
            out = self.code(*args)
            args.clear()
            return [out] if self.single else list(out)
        return list(self.code(args))

    def __getstate__(self) -> dict:
        if isinstance(self.code, GraphCode):
            return {"code": self.code, "single": self.single}
        saved = self.saved if self.saved is not None else saved_form(self.code)
        if isinstance(saved, str):
            raise TypeError(f"a compiled graph did not pickle when it was compiled: {saved}")
        return {"saved": saved, "single": self.single}

    def __setstate__(self, state: dict) -> None:
        self.single, self.saved = state["single"], None
        self.code = state["code"] if "code" in state else _reload(pickle.loads(state["saved"]))


def saved_form(graph: Any) -> bytes | str:
    """``graph`` (a ``CompiledFxGraph``) pickled the way Inductor's cache stores one, or why it does
    not pickle. With no dispatch mode active: a constant must pickle as the real tensor it is."""
    try:  # a graph that cannot be prepared or pickled costs the save, never the compile
        with torch_seams.launched_kernels_picklable(graph):
            graph = copy.copy(graph)
            graph.prepare_for_serialization()
            with torch_seams.no_dispatch_modes():
                return pickle.dumps(graph)
    except Exception as e:  # noqa: BLE001 - whatever stops it, the program is not saved, and says why
        return f"{type(e).__name__}: {e}"


def _reload(graph: Any) -> Any:
    """A deserialized ``CompiledFxGraph`` made callable again: its source written back to Inductor's
    code cache and loaded (what Inductor does on an FX-graph-cache hit), its output strides not
    reported to the enclosing compile (they are not the enclosing graph's)."""
    loaded = dropping_damaged_files(lambda: torch_seams.reload_compiled_graph(graph), "loading a cached program")
    if loaded is None:
        raise RuntimeError("a compiled graph of the cached program could not be reloaded from Inductor's code cache")
    return loaded


def compile_boxed(gm: GraphModule, compiler: str, static_input_idxs: Sequence[int] = (),
                  inputs: Sequence[Any] | None = None) -> BoxedGraph:
    """``gm`` compiled as a :class:`BoxedGraph`, for ``inputs`` (by default its placeholders' fake
    values)."""
    single = not returns_tuple(gm)
    if compiler == "eager":
        return BoxedGraph(GraphCode(gm), single)
    inputs = example_inputs(gm) if inputs is None else inputs
    compiled = inductor(_with_tuple_output(gm) if single else gm, inputs, static_input_idxs)
    return BoxedGraph(compiled, single, saved_form(compiled) if _SAVING.get() else None)


class Submodule:
    """A boxed callable called as a submodule: positional inputs, one value or a tuple out."""

    def __init__(self, fn: BoxedGraph):
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        out = self.fn(list(args))
        return out[0] if self.fn.single else tuple(out)


def swap_submodule(parent: GraphModule, name: str, fn: Callable[..., Any]) -> None:
    """Replace submodule ``name`` by a plain callable; the parent's generated code calls it unchanged."""
    delattr(parent, name)
    setattr(parent, name, fn)
