"""The callable a cut graph compiles to: full region, gathers, reduced region, and the per-step gate.

Per step (the seed's FastPrefillHelper, made explicit):
- R == 0 (no request reaches a logits row): the reduced region is skipped; its outputs are empty.
- no step metadata, a whole-step CUDA graph, a pure decode batch, or padded R >= T: the full-rows
  path runs the reduced region on all T rows (query_rows = every row) and selects the logits rows
  at the end, which computes exactly what the model without the pass computes. Each is counted
  and logged with its reason.
- otherwise the boundary tensors are gathered and the reduced region runs on R rows.

A suffix selection (transformers' ``logits_to_keep``: the last k rows of every sequence) needs no
per-step metadata and has no gate: every call gathers and runs the reduced region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy
import torch
from torch.fx import GraphModule, Node

from . import fallbacks as reasons
from .step_context import current_step

RegionFn = Callable[[list], list]


@dataclass
class SizeSource:
    """Where a size symbol can be read at run time: dim ``dim`` of graph input ``index``."""
    index: int
    dim: int


class FastPrefillModule:
    _boxed_call = True

    def __init__(self, gm: GraphModule, stages: dict, compiled: dict[str, RegionFn], index: Node,
                 rows: sympy.Symbol, reduced_rows: sympy.Expr, record_fallback: Callable[[str], None],
                 suffix: bool = False, copy_outputs: bool = False):
        self.gm = gm
        self.stages = stages
        self.compiled = compiled
        self.index = index
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.constants = {n: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        self.output_args = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self._record = record_fallback  # counts (and logs) a step that leaves the fast path
        self.sources = self._size_sources()
        self.rows, self.reduced_rows = rows, reduced_rows
        if rows not in self.sources:
            raise ValueError("the token count is not the size of any graph input")
        self.suffix = suffix
        self.copy_outputs = copy_outputs  # CUDA graphs: outputs are views of memory the next call rewrites
        self.row_axes = {} if suffix else self._reduced_output_axes()

    def _size_sources(self) -> dict[sympy.Symbol, SizeSource]:
        sources = {}
        for i, node in enumerate(self.placeholders):
            val = node.meta.get("val")
            sizes = val.shape if isinstance(val, torch.Tensor) else [val] if isinstance(val, torch.SymInt) else []
            for d, size in enumerate(sizes):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(size.node.expr, SizeSource(i, d if isinstance(val, torch.Tensor) else -1))
        return sources

    def _reduced_output_axes(self) -> dict[Node, int]:
        """For each reduced-region value the graph returns: the dim holding the logits rows."""
        axes = {}
        for node in self.stages["reduced"].outputs:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise ValueError(f"reduced-region output {node.name} is not a tensor")
            found = [d for d, s in enumerate(val.shape)
                     if isinstance(s, torch.SymInt) and self.reduced_rows in s.node.expr.free_symbols]
            if len(found) != 1 or val.shape[found[0]].node.expr != self.reduced_rows:
                raise ValueError(f"reduced-region output {node.name} has shape {tuple(val.shape)}: its logits rows are not one plain dim")
            axes[node] = found[0]
        return axes

    def _size(self, symbol: sympy.Symbol, args: list) -> int:
        src = self.sources[symbol]
        value = args[src.index]
        return int(value) if src.dim < 0 else value.shape[src.dim]

    def _empty_output(self, node: Node, args: list, rows: int) -> torch.Tensor:
        val = node.meta["val"]
        values = {sym: self._size(sym, args) for sym in self.sources}
        values[self.reduced_rows] = rows
        shape = [int(s.node.expr.subs(values)) if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
        return torch.empty(shape, dtype=val.dtype, device=args[self.placeholders.index(self.index)].device)

    def _run_stage(self, name: str, env: dict) -> None:
        stage = self.stages[name]
        outputs = self.compiled[name]([env[n] for n in stage.inputs])
        env.update(zip(stage.outputs, outputs))

    def __call__(self, args: list) -> list:
        outputs = self._forward(args)
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs] if self.copy_outputs else outputs

    def _forward(self, args: list) -> list:
        env = dict(zip(self.placeholders, args))
        env.update(self.constants)
        shapes_args = list(args)
        args.clear()  # boxed calling convention: let inputs die early
        self._run_stage("full", env)
        if self.suffix:
            self._run_gathers(env)
            self._run_stage("reduced", env)
            return [env[a] if isinstance(a, Node) else a for a in self.output_args]
        index = env[self.index]
        num_tokens = self._size(self.rows, shapes_args)
        step = current_step()
        reason = None
        if index.shape[0] == 0 or (step is not None and step.num_logits == 0):
            # Padded rows of an R == 0 step are never read: the outputs keep their padded size.
            self._record(reasons.NO_LOGITS_ROWS)
            for node in self.stages["reduced"].outputs:
                env[node] = self._empty_output(node, shapes_args, index.shape[0])
        else:
            if step is None:
                reason = reasons.NO_STEP_METADATA
            elif step.whole_step_graph:
                reason = reasons.WHOLE_STEP_GRAPH
            elif not step.has_prefill:
                reason = reasons.PURE_DECODE
            elif index.shape[0] >= num_tokens:
                reason = reasons.NOT_SMALLER
            if reason is None:
                self._run_gathers(env)
                self._run_stage("reduced", env)
            else:
                self._record(reason)
                self._run_full_rows(env, index, num_tokens)
        return [env[a] if isinstance(a, Node) else a for a in self.output_args]

    def _run_gathers(self, env: dict) -> None:
        for node in self.stages["boundary"].nodes:
            env[node] = node.target(*torch.fx.node.map_arg(node.args, env.__getitem__))

    def _run_full_rows(self, env: dict, index: torch.Tensor, num_tokens: int) -> None:
        # Gathering every row keeps the memory layout the reduced region was compiled for.
        env[self.index] = torch.arange(num_tokens, device=index.device, dtype=index.dtype)
        self._run_gathers(env)
        self._run_stage("reduced", env)
        env[self.index] = index
        for node, axis in self.row_axes.items():
            env[node] = env[node].index_select(axis, index)
