"""fx_fastprefill: prefill of KV-sharing language models on the logits rows only, as a torch.compile backend."""

from __future__ import annotations

import os as _os

# In a source checkout the passes live in the top-level ``passes/`` folder; an installed package
# has them as ``fx_fastprefill/passes`` (pyproject's package-dir). Make the checkout importable the
# same way, so ``PYTHONPATH=.`` works without installing.
_checkout_passes = _os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "passes")
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "passes")) and _os.path.isdir(_checkout_passes):
    __path__.append(_os.path.dirname(_checkout_passes))  # type: ignore[name-defined]  # noqa: F821

from .attention_op import attention  # noqa: E402
from .batch import SeqChunk  # noqa: E402
from .kv_cache import KVCache  # noqa: E402
from .runner import Runner  # noqa: E402
from .step_context import StepMetadata, current_step, step_context  # noqa: E402

__all__ = [
    "attention", "backend", "Runner", "SeqChunk", "KVCache", "StepMetadata", "step_context", "current_step",
    "FastPrefillReport",
]


def __getattr__(name: str):
    # backend and report import the passes and Inductor: load them on first use.
    if name == "backend":
        from .compile_backend import backend
        return backend
    if name == "FastPrefillReport":
        from .report import FastPrefillReport
        return FastPrefillReport
    raise AttributeError(f"module 'fx_fastprefill' has no attribute {name!r}")
