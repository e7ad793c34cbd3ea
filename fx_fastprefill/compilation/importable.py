"""Values named by how to import them again: how generated code's globals (an FX graph's, the
bytecode Dynamo saves) are pickled, by reference, and resolved in another process."""

from __future__ import annotations

import builtins
import importlib
import math
import sys
from typing import Any

Reference = tuple[str, ...]


def reference_to(value: Any) -> Reference | None:
    """``("module", name)``, ``("attr", module, qualname)`` or ``("float", repr)`` for ``value``;
    None where it cannot be imported by name (a local function, an instance)."""
    if isinstance(value, type(sys)):
        return ("module", value.__name__)
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return ("float", repr(value))
    if value is type(None):  # its __module__ says builtins, which has no such name
        return ("attr", "types", "NoneType")
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<locals>" in qualname:
        return None
    reference = ("attr", module, qualname)
    try:
        return reference if resolve(reference) is value else None
    except (ImportError, AttributeError):
        return None


def resolve(reference: Reference) -> Any:
    """The value a :func:`reference_to` result names."""
    if reference[0] == "module":
        return importlib.import_module(reference[1])
    if reference[0] == "float":
        return float(reference[1])
    value: Any = importlib.import_module(reference[1]) if reference[1] != "builtins" else builtins
    for part in reference[2].split("."):
        value = getattr(value, part)
    return value
