"""What a saved compiled function was compiled for, as one key: the model's class, config, tensor
shapes and the sources of its classes and forwards, this package's sources, the options, torch and
Python (compilation/precompiled.py); and the digests of the source files Dynamo traced, checked
again when the function is loaded."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import sys
import types
from pathlib import Path
from typing import Any, Callable

import torch

from .. import torch_seams
from . import program_cache


def model_key(model: torch.nn.Module, options: str, hidden: tuple[str, ...] = ()) -> str:
    """What a saved function was compiled for: the model's class (and the version of the package
    that defines it), config, parameter and buffer shapes, dtypes and devices, the source files of
    its modules' classes and the ``forward`` each class runs (an edited modeling file or a patched
    class: another key, whatever the package's version says), the functions set on its modules'
    instances (a patched method, an activation's partial: their identity guards are not saved),
    this package's sources, ``options``, torch and Python. ``hidden``: attributes of the model's
    own instance left out (the caller's wrappers)."""
    config = getattr(model, "config", None)
    config_text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    tensors = [(name, tuple(t.shape), str(t.dtype), t.device.type)
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    functions = [(path, attribute, _describe(value))
                 for path, module in model.named_modules() for attribute, value in vars(module).items()
                 if callable(value) and not isinstance(value, (torch.nn.Module, type))
                 and not (module is model and attribute in hidden)]
    defining_package = sys.modules.get(type(model).__module__.split(".")[0])
    text = "\n".join([f"{type(model).__module__}.{type(model).__qualname__}",
                      str(getattr(defining_package, "__version__", None)), config_text, repr(tensors), repr(functions),
                      repr(_class_sources(model)), program_cache.package_digest(), options, torch.__version__,
                      sys.version])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _class_sources(model: torch.nn.Module) -> list[tuple]:
    """Per class of the model's modules: the digest of each file that defines a class of its MRO
    (torch's own excepted: torch's version is keyed) and the ``forward`` it resolves to."""
    described = []
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: (c.__module__, c.__qualname__)):
        files = sorted({module for c in cls.__mro__ if not _is_torchs(module := c.__module__)})
        described.append((cls.__module__, cls.__qualname__, [(m, _source_digest(m)) for m in files],
                          _describe(getattr(cls, "forward", None))))
    return described


def _is_torchs(module: str) -> bool:
    return module == "builtins" or module == "torch" or module.startswith("torch.")


def _source_digest(module: str) -> str | None:
    """The sha256 of the source file of ``module`` as it is on disk now; None where it has none."""
    loaded = sys.modules.get(module)
    path = getattr(loaded, "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
        path = spec.origin if spec is not None and spec.has_location else None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None
    except OSError:
        return None


def traced_sources(function: Any) -> dict[str, str]:
    """The source files of the code Dynamo traced for a compiled function (the function and every
    function it inlined), by module, each with its content's digest. Raises ValueError where one
    has no file to check it by on load."""
    modules = sorted({source.module for source in function.source_info().inlined_sources})
    digests = {module: _source_digest(module) for module in modules}
    missing = [module for module, digest in digests.items() if digest is None]
    if missing:
        raise ValueError(f"the traced code of {missing} has no source file to check it by on load")
    return digests


def changed_sources(saved: dict[str, str]) -> list[str]:
    """The modules whose source files differ from the digests ``saved`` with a function."""
    return [module for module, digest in saved.items() if _source_digest(module) != digest]

def _describe(value: Any) -> tuple:
    """A callable by what it runs: name and code (constants and nested code included), or a
    partial's function and arguments; the type's name for anything else."""
    if isinstance(value, functools.partial):
        return "partial", _describe(value.func), repr(value.args), repr(sorted(value.keywords.items()))
    if inspect.ismethod(value):
        return "method", _describe(value.__func__)
    if inspect.isfunction(value):
        return "function", value.__module__, value.__qualname__, _code_digest(value.__code__)
    return type(value).__module__, type(value).__qualname__, getattr(value, "__qualname__", None)


def _code_digest(code: types.CodeType) -> str:
    digest = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        digest.update((_code_digest(const) if isinstance(const, types.CodeType) else repr(const)).encode())
    digest.update(repr(code.co_names).encode())
    return digest.hexdigest()[:16]


def serializable_guards(closure: tuple[str, ...] = ()) -> Callable[[list[Any]], list[bool]]:
    """Dynamo's guard filter: keep every guard a saved function can check in another process (not
    object identities, not globals, not the traced function's closure, which is handed in again
    on load). What the dropped ones pinned is in :func:`model_key`."""
    unsupported = torch_seams.unsupported_serialization_guard_types()
    closure_names = set(closure)
    prefixes = tuple(name + sep for name in closure for sep in ".[")

    def keep(entries: list[Any]) -> list[bool]:
        return [not (e.is_global or e.guard_type in unsupported or unsupported & set(e.derived_guard_types or ())
                     or e.name in closure_names or (prefixes and e.name.startswith(prefixes))) for e in entries]
    return keep
