"""One compilation for every token count T and logits-row count R, 0 and 1 included.

Dynamo specializes sizes 0 and 1 by default, so a decode step (T == 1), a single logits row
(R == 1) or a step without logits rows (R == 0) would each recompile. Size-oblivious reasoning for
backed sizes removes those specializations; it is a feature of the installed torch, gated on its
presence rather than on a version string.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

try:
    import torch.fx.experimental._config as _fx_config
except ImportError:  # pragma: no cover - very old torch
    _fx_config = None

HAS_SIZE_OBLIVIOUS = _fx_config is not None and hasattr(_fx_config, "backed_size_oblivious")
# Off for now: with it, Inductor's CPU code for the reduced region came out wrong for some row
# counts (docs/design.md, "Known issues"); without it Dynamo compiles at most three graphs
# (sizes 0, 1 and the general one) instead of one.
SIZE_OBLIVIOUS_ENABLED = False


@contextlib.contextmanager
def varying_sizes() -> Iterator[None]:
    """Trace (and guard) with sizes treated as size-oblivious, so 0 and 1 are not special."""
    if _fx_config is None:
        yield
        return
    # Duck shaping would give T and R one symbol whenever they happen to be equal when traced.
    patches = {"use_duck_shape": False}
    if HAS_SIZE_OBLIVIOUS and SIZE_OBLIVIOUS_ENABLED:
        patches["backed_size_oblivious"] = True
    with _fx_config.patch(**patches):
        yield


def compile_for_varying_sizes(model: nn.Module, backend: Any) -> Any:
    """``torch.compile`` with every input size dynamic from the first call."""
    return torch.compile(model, backend=backend, dynamic=True)


@contextlib.contextmanager
def exact_size_reasoning() -> Iterator[None]:
    """Inductor codegen without size-oblivious reasoning: with it, Inductor's CPU code for a region
    with several row counts came out wrong for some sizes (see docs/design.md); the guards were
    already decided by Dynamo, so codegen loses nothing by reasoning exactly."""
    if not HAS_SIZE_OBLIVIOUS:
        yield
        return
    with _fx_config.patch(backed_size_oblivious=False):
        yield
