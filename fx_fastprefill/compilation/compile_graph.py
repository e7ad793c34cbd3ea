"""One graph (a region or a piece) compiled on its own, called the way its GraphModule is called.

``split_module`` makes the regions and pieces submodules that take their inputs positionally and
return one value or a tuple; the compiled callable swapped in for a submodule keeps that
convention, so the calling graph's code is the same whether a submodule is compiled or not.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule

from .dynamic_shapes import exact_size_reasoning

BoxedFn = Callable[[list], list]
COMPILERS = ("inductor", "eager")


def inductor(gm: GraphModule, example_inputs: Sequence, static_input_idxs: Sequence[int]) -> BoxedFn:
    """``compile_fx_inner`` on one graph that returns a tuple, in its own tracing context (Inductor
    records the output strides of one graph per context); parameters (``static_input_idxs``) keep
    their addresses."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool
    with tracing(TracingContext(detect_fake_mode(list(example_inputs)))), exact_size_reasoning():
        return compile_fx_inner(gm, list(example_inputs), is_inference=True, cudagraphs=BoxedBool(False),
                                static_input_idxs=list(static_input_idxs))


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


def compile_boxed(gm: GraphModule, compiler: str, static_input_idxs: Sequence[int] = ()) -> BoxedFn:
    """``gm`` as a boxed callable: a list of inputs in (cleared), a list of outputs out."""
    single = not returns_tuple(gm)
    if compiler == "eager":
        def run(args: list) -> list:
            out = gm(*args)
            args.clear()
            return [out] if single else list(out)
        return run
    compiled = inductor(_with_tuple_output(gm) if single else gm, example_inputs(gm), static_input_idxs)

    def run_compiled(args: list) -> list:
        return list(compiled(args))
    return run_compiled


def as_submodule(fn: BoxedFn, single: bool) -> Callable[..., Any]:
    """A boxed callable called as a submodule: positional inputs, one value or a tuple out."""
    if single:
        return lambda *args: fn(list(args))[0]
    return lambda *args: tuple(fn(list(args)))


def swap_submodule(parent: GraphModule, name: str, fn: Callable[..., Any]) -> None:
    """Replace submodule ``name`` by a plain callable; the parent's generated code calls it unchanged."""
    delattr(parent, name)
    setattr(parent, name, fn)
