"""The callable a cut graph compiles to: its two regions, compiled, behind the per-step gate.

``passes/split_regions.py`` makes the cut graph a GraphModule that calls a ``full`` and a
``reduced`` submodule; here each is replaced by its compiled callable (one Inductor graph, or a
:class:`PiecewiseRegion` with CUDA graphs), the reduced one behind a :class:`StepGate`.

Per step, the gate obeys the step's plan (``StepMetadata.reduced``, made by the Runner from the
step's padded sizes; made here from the sizes the region is called with where the step has none:
``ops/step_context.py: plan_reduced_region``):
- R == 0 (no request reaches a logits row): the reduced region is skipped; its outputs are empty.
- no step metadata, a pure decode batch, or padded R >= T: the full-rows path runs the reduced
  region on all T rows (``logits_indices = arange(T)``) and selects the logits rows at the end,
  which computes exactly what the model without the pass computes. Each is counted and logged with
  its reason.
- otherwise the reduced region gathers the boundary tensors and runs on R rows.
- a step recorded as a whole-step CUDA graph (``StepMetadata.graph_mode == WHOLE_STEP``: every row a
  logits row, the rows passed as ``arange(T)``) runs the region on all rows, uncounted: the
  reference document's rule turns fast prefill off for such steps, and they are decode steps.

A transformers graph's selection (``logits_to_keep``: the last k rows of every sequence, or the rows
of an index tensor) needs no per-step metadata and has no gate: every call gathers and runs the
reduced region (``HoistPlan.per_step`` is False).
"""

from __future__ import annotations

from typing import Any, Callable

import sympy
import torch
from torch.fx import GraphModule, Node

from fx_fastprefill.passes.fx_utils import output_args, placeholders, size_sources

from ..ops.step_context import REDUCED_LOGITS_ROWS, REDUCED_SKIP, current_step, plan_reduced_region
from . import program_env


class StepGate:
    """The reduced region behind the per-step decision; called as the ``reduced`` submodule.

    Holds what it reads of the region as plain data (positions, size symbols, output shapes), so
    a compiled program pickles with it; a step that leaves the fast path is counted by the running
    program's env (compilation/program_env.py)."""

    def __init__(self, run: Callable[..., Any], region: GraphModule, index: str, rows: sympy.Symbol,
                 reduced_rows: sympy.Expr):
        self.run = run
        inputs = placeholders(region)
        self.index_position = next(i for i, n in enumerate(inputs) if n.name == index)
        self.sources = size_sources(inputs)
        if rows not in self.sources:
            raise ValueError("the token count is not the size of any input of the reduced region")
        self.rows, self.reduced_rows = rows, reduced_rows
        outputs = output_args(region)
        self.single = not isinstance(outputs, (tuple, list))
        nodes: list[Node] = [outputs] if self.single else list(outputs)
        self.row_axes = [self._row_axis(node) for node in nodes]
        self.output_shapes = [tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in n.meta["val"].shape)
                              for n in nodes]
        self.output_dtypes = [n.meta["val"].dtype for n in nodes]

    def _row_axis(self, node: Node) -> int:
        """The dim of a reduced-region output that holds the logits rows."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"reduced-region output {node.name} is not a tensor")
        found = [d for d, s in enumerate(val.shape)
                 if isinstance(s, torch.SymInt) and self.reduced_rows in s.node.expr.free_symbols]
        if len(found) != 1 or val.shape[found[0]].node.expr != self.reduced_rows:
            raise ValueError(
                f"reduced-region output {node.name} has shape {tuple(val.shape)}: its logits rows are not one plain dim"
            )
        return found[0]

    def _size(self, symbol: sympy.Symbol, args: tuple) -> int:
        i, dim = self.sources[symbol]
        return int(args[i]) if dim is None else args[i].shape[dim]

    def __call__(self, *args: Any) -> Any:
        index = args[self.index_position]
        num_tokens = self._size(self.rows, args)
        plan = plan_reduced_region(current_step(), index.shape[0], num_tokens)
        if plan.fallback is not None:
            program_env.current().record_fallback(plan.fallback)
        if plan.mode == REDUCED_LOGITS_ROWS:
            return self.run(*args)
        if plan.mode == REDUCED_SKIP:
            # Padded rows of an R == 0 step are never read: the outputs keep their padded size.
            return self._pack([self._empty(shape, dtype, args, index)
                               for shape, dtype in zip(self.output_shapes, self.output_dtypes)])
        # Every row through the same gathers keeps the memory layout the region was compiled for.
        full_rows = list(args)
        full_rows[self.index_position] = torch.arange(num_tokens, device=index.device, dtype=index.dtype)
        out = self.run(*full_rows)
        outputs = [out] if self.single else list(out)
        return self._pack([o.index_select(axis, index) for o, axis in zip(outputs, self.row_axes)])

    def _pack(self, outputs: list) -> Any:
        return outputs[0] if self.single else tuple(outputs)

    def _empty(self, shape: tuple, dtype: torch.dtype, args: tuple, index: torch.Tensor) -> torch.Tensor:
        values = {symbol: self._size(symbol, args) for symbol in self.sources}
        values[self.reduced_rows] = index.shape[0]
        sizes = [int(sympy.sympify(s).subs(values)) for s in shape]
        return torch.empty(sizes, dtype=dtype, device=index.device)


class CompiledProgram:
    """The backend's compiled callable (boxed): the split graph with its regions swapped in (or,
    for a graph compiled unchanged, the one compiled graph). Plain data: it pickles whole, and
    what it needs at run time (the fallback sink, the graphs it records) comes from the env of
    the call (compilation/program_env.py).

    ``copy_outputs``: with CUDA graphs, outputs are views of memory the next call rewrites."""

    _boxed_call = True

    def __init__(self, split: Callable[..., Any], copy_outputs: bool = False):
        self.split = split
        self.copy_outputs = copy_outputs

    def __call__(self, args: list) -> list:
        inputs = tuple(args)
        args.clear()  # boxed calling convention: the caller's list no longer holds the inputs
        outputs = self.split(*inputs)
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        if self.copy_outputs:
            outputs = [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]
        return outputs
