"""fx_fastprefill: prefill of KV-sharing language models on the logits rows only, as a torch.compile backend."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _import_checkout_passes() -> None:
    """The passes live in the source tree's top-level ``passes/``; installed, they are
    ``fx_fastprefill/passes`` (pyproject's package-dir). From a checkout on ``PYTHONPATH`` (no
    install) the top-level folder is imported under that name; neither there is an error."""
    here = Path(__file__).parent
    if (here / "passes").is_dir() or "fx_fastprefill.passes" in sys.modules:
        return
    init = here.parent / "passes" / "__init__.py"
    if not init.is_file():
        raise ImportError(f"fx_fastprefill.passes not found: neither {here / 'passes'} (installed) nor {init} (checkout)")
    spec = importlib.util.spec_from_file_location("fx_fastprefill.passes", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fx_fastprefill.passes"] = module
    spec.loader.exec_module(module)


_import_checkout_passes()

from .compilation.logs import configure_logging as _configure_logging  # noqa: E402

_configure_logging()

from .ops import sdpa as _sdpa  # noqa: E402,F401  (the sdpa op's kernels)
from .ops.attention import attention  # noqa: E402
from .runtime.batch import SeqChunk  # noqa: E402
from .runtime.kv_cache import KVCache  # noqa: E402
from .runtime.runner import Runner  # noqa: E402
from .runtime.step_context import StepMetadata, current_step, step_context  # noqa: E402

__all__ = [
    "attention", "backend", "Runner", "SeqChunk", "KVCache", "StepMetadata", "step_context", "current_step",
    "FastPrefillReport",
]


def __getattr__(name: str):
    # The backend imports Inductor: loaded on first use, not with the package.
    if name == "backend":
        from .compilation.backend import backend
        return backend
    if name == "FastPrefillReport":
        from .report.report import FastPrefillReport
        return FastPrefillReport
    raise AttributeError(f"module 'fx_fastprefill' has no attribute {name!r}")
