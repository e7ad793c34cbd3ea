"""One compilation for every token count T and logits-row count R the Runner sends.

Dynamo specializes sizes 0 and 1, so the Runner never sends them: a lone decode token is padded
with a row of a padding request, and logits rows are padded up from 2 (runtime/batch.py). What is
left here: every size dynamic from the first call, and T and R never merged into one symbol.
Size-oblivious reasoning (which would make 0 and 1 ordinary sizes) is kept off in codegen: with
it, Inductor's CPU code for the reduced region came out wrong for some row counts (docs/design.md,
"Known issues").
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from ..torch_seams import fx_config as _fx_config


@contextlib.contextmanager
def varying_sizes() -> Iterator[None]:
    """Trace without duck shaping: it would give T and R one symbol whenever they happen to be
    equal when traced."""
    with _fx_config.patch(use_duck_shape=False):
        yield


def compile_for_varying_sizes(model: nn.Module, backend: Any) -> Any:
    """``torch.compile`` with every input size dynamic from the first call."""
    return torch.compile(model, backend=backend, dynamic=True)


@contextlib.contextmanager
def exact_size_reasoning() -> Iterator[None]:
    """Inductor codegen without size-oblivious reasoning (see the module docstring); the guards
    were already decided by Dynamo, so codegen loses nothing by reasoning exactly."""
    if not hasattr(_fx_config, "backed_size_oblivious"):
        yield
        return
    with _fx_config.patch(backed_size_oblivious=False):
        yield
