"""Fake values (``meta["val"]``) after a pass rewires or resizes nodes: recomputed downstream of
what changed, as far as they change.

Kept rather than Inductor's ``FakeTensorUpdater`` (which also stops where values stop changing):
that class is private to Inductor, hashes the graph when it is made (before the rewrite, so every
pass would have to build one up front), and assumes the outermost graph's inputs and outputs keep
their meaning, which a pass that moves a gather does not promise. One function, shared by the
passes that change sizes (``cut_graph``, ``narrow_sliced_producers``).
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from .fx_utils import placeholders
from .token_layout import size_expr


def refresh_fake_values(gm: GraphModule, changed: list[Node]) -> None:
    """Recompute ``meta["val"]`` downstream of ``changed``, in graph order, as far as values change.

    A recomputed node whose value has its own storage and the same sizes, strides, offset, dtype
    and device as before keeps its old value, and its readers are not recomputed: most of a graph
    is downstream of the cut, and faking every op of it again under symbolic sizes takes seconds
    per thousand nodes. Views are always refreshed (their value aliases their input's)."""
    fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders(gm)])
    dirty = set(changed)

    def value(arg):
        return arg.meta["val"] if isinstance(arg, Node) else arg

    with fake_mode:
        for node in gm.graph.nodes:
            if node.op != "call_function" or (node not in dirty and not any(a in dirty for a in node.all_input_nodes)):
                continue
            args = torch.fx.node.map_aggregate(node.args, value)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
            new = node.target(*args, **kwargs)
            if node not in dirty and _same_fresh_tensor(node.meta.get("val"), new):
                continue
            dirty.add(node)
            node.meta["val"] = new
            node.meta.pop("tensor_meta", None)  # stale sizes; Inductor's passes read it when present


def _same_fresh_tensor(old, new) -> bool:
    """Both tensors, ``new`` not a view, with equal sizes, strides, offset, dtype and device."""
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor) or new._is_view():
        return False
    if (old.dtype, old.device, old.dim()) != (new.dtype, new.device, new.dim()):
        return False
    return all(size_expr(a) == size_expr(b) for a, b in zip(
        (*old.shape, *old.stride(), old.storage_offset()), (*new.shape, *new.stride(), new.storage_offset())))
