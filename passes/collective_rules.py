"""Hoisting rules of ``torch.distributed``'s functional collectives (what tensor parallelism
traces to).

Invariant: row-wise when they combine or copy ranks' tensors element by element (all-reduce,
broadcast, wait) or concatenate them on a dim that is not the token dim (all-gather,
reduce-scatter on dim 0): every rank gathers the same rows (the row selection is computed from
replicated inputs, and ranks check they planned the same cut, compilation/spmd.py), so the
collective of the gathered rows is the gathered rows of the collective. Over the token dim
(sequence parallelism) they stop.
"""

from __future__ import annotations

import torch

from .rule_registry import Requirement, RuleResult, rule

c10d = torch.ops._c10d_functional


@rule(c10d.all_reduce.default, c10d.broadcast.default, c10d.wait_tensor.default)
def _rowwise_collective(node, layout, rows):
    """Element by element across ranks: the output's rows are the input's rows."""
    return RuleResult([Requirement(("args", 0), node.args[0], layout)])


@rule(c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
def _dim0_collective(node, layout, rows):
    """Ranks' tensors concatenated (or reduced and scattered) on dim 0: row-wise when the token rows
    are on another dim. On dim 0 it is sequence parallelism: the ranks hold different tokens."""
    if layout.axis == 0:
        return f"{node.target.name()} over the token dim (sequence parallelism: ranks hold different rows)"
    return RuleResult([Requirement(("args", 0), node.args[0], layout)])
