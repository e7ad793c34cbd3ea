"""Dynamo settings that make the guards of a compiled model cheap to check on every step.

Dynamo checks its guards before every call of a compiled model, on the host, while the GPU waits
for the step's first kernel. On a 35-layer model with default settings that check took 1.2-1.8 ms
per step (the whole module tree walked, ~2800 guard nodes), and every ``eps`` or ``softcap`` float
attribute was a graph input with a Python-level ``isnan`` guard. The Runner traces with:

- ``specialize_float``: float attributes are constants of the graph, guarded by value (a change
  recompiles), not inputs re-read and re-checked every call;
- ``use_recursive_dict_tags_for_guards``: an unchanged module subtree (no attribute of any of its
  modules set or deleted since the last call) is accepted by its dict tags alone, without walking
  it. Setting an attribute (``layer.eps = ...``, a new parameter) changes a tag, so the full guards
  run and catch the change. What it assumes is what torch's default already assumes for parameter
  tensors (``skip_tensor_guards_with_matching_dict_tags``): a parameter's tensor is not swapped in
  place (``param.data = other``); use a new Runner after re-typing or re-placing a model.

Both are Dynamo trace-time settings: they take effect for graphs traced inside this context.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ..torch_seams import dynamo_config

# Each only where the installed torch has it; decided once, not on every step.
_SETTINGS = {k: v for k, v in {"specialize_float": True, "use_recursive_dict_tags_for_guards": True}.items()
             if hasattr(dynamo_config, k)}


@contextlib.contextmanager
def cheap_guards() -> Iterator[None]:
    """Trace with the settings above."""
    with dynamo_config.patch(**_SETTINGS):
        yield
