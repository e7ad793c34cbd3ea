"""fx_fastprefill: prefill of KV-sharing language models on the logits rows only, as a torch.compile backend."""

from __future__ import annotations

import os as _os

# In a source checkout the passes live in the top-level ``passes/`` folder; an installed package
# has them as ``fx_fastprefill/passes`` (pyproject's package-dir). Load the checkout's folder under
# that name, so ``PYTHONPATH=.`` works without installing (and nothing else of the checkout
# becomes part of the package).


def _load_checkout_passes() -> None:
    import importlib.util
    import sys
    here = _os.path.dirname(__file__)
    init = _os.path.join(_os.path.dirname(here), "passes", "__init__.py")
    if "fx_fastprefill.passes" in sys.modules or _os.path.isdir(_os.path.join(here, "passes")) or not _os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location("fx_fastprefill.passes", init, submodule_search_locations=[_os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fx_fastprefill.passes"] = module
    spec.loader.exec_module(module)


_load_checkout_passes()

from .logs import configure_logging as _configure_logging  # noqa: E402

_configure_logging()

from .attention_op import attention  # noqa: E402
from . import sdpa_op as _sdpa_op  # noqa: E402,F401  (registers fx_fastprefill::sdpa)
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
