"""fx_fastprefill: prefill of KV-sharing language models on the logits rows only, as a torch.compile backend."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _import_checkout_passes() -> None:
    """The passes live in the source tree's top-level ``passes/``, installed as
    ``fx_fastprefill.passes`` (pyproject's package-dir): a wheel puts them there, an editable install
    maps the name with setuptools' finder, and the standard import machinery finds both. Only a
    checkout on ``PYTHONPATH`` with nothing installed has no mapping: the top-level folder is then
    loaded under that name and bound on this package, as an import would."""
    name = "fx_fastprefill.passes"
    here = Path(__file__).resolve().parent
    init = here.parent / "passes" / "__init__.py"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    # An install's passes serve this package only if they are this tree's (a wheel's, or the
    # editable mapping to this checkout), not another checkout's install found on the path.
    if spec is not None and spec.origin and Path(spec.origin).resolve() in (here / "passes" / "__init__.py", init):
        return
    if not init.is_file():
        if spec is not None:
            return
        raise ImportError(f"{name} not found: not installed, and no checkout folder {init.parent}")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    globals()["passes"] = module


_import_checkout_passes()

from .logs import configure_logging as _configure_logging  # noqa: E402
from .ops import schema as _schema  # noqa: E402,F401  (defines the package's ops)

_configure_logging()

# The public names, each loaded on first use: importing the passes (or this package) loads no
# kernel, Triton or Inductor.
_EXPORTS = {
    "attention": "fx_fastprefill.ops.attention",
    "backend": "fx_fastprefill.compilation.backend",
    "Runner": "fx_fastprefill.runtime.runner",
    "SeqChunk": "fx_fastprefill.runtime.batch",
    "KVCache": "fx_fastprefill.ops.kv_cache",
    "StepMetadata": "fx_fastprefill.ops.step_context",
    "step_context": "fx_fastprefill.ops.step_context",
    "current_step": "fx_fastprefill.ops.step_context",
    "FastPrefillReport": "fx_fastprefill.report.report",
    "compile_for_generate": "fx_fastprefill.integrations.generate",
    "restore": "fx_fastprefill.integrations.generate",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fx_fastprefill' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
