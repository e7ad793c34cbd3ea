"""transformers ``generate`` through the pass, with one call: ``compile_for_generate(model)``.

``generate`` calls ``self(...)`` for the prefill and for every decode step. The model's ``forward``
is replaced, on the instance only, by :class:`GenerateForward`, which sends each call down one of
two compiled paths:

- **prefill** (more than one new token per sequence): the model's forward compiled through the
  fx_fastprefill backend, the prompt-length dims dynamic: one graph for every prompt length, cut on the
  ``logits_to_keep`` rows ``generate`` asks for;
- **decode** (one new token per sequence): with a static cache, the forward compiled by Inductor
  the way transformers compiles its own decode (``mode="reduce-overhead"``: CUDA graphs on CUDA);
  with a ``DynamicCache`` uncompiled, as transformers runs it: its tensors grow every step, so no
  CUDA graph can hold them, and a dynamic-shape compile of a one-token step costs compiles (two per
  model, about a minute each at Gemma E2B size) for little.

Why not ``torch.compile(model).generate()``: ``torch.compile`` wraps the module's ``__call__`` in
a new object, and its ``generate`` attribute is the original module's, which calls the original,
uncompiled ``__call__``. Nothing is compiled and nothing says so. ``compile_for_generate`` patches
the module itself, so its own ``generate`` (and any other caller of ``model(...)``) runs the
compiled paths; given a ``torch.compile`` wrapper it unwraps it, with a warning.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .. import fallbacks, torch_seams
from ..compilation.backend import FastPrefillBackend
from ..compilation.backend import backend as make_backend
from ..compilation import precompiled
from .generate_inputs import (cache_of, clear_dim_marks, graphs_compiled, input_ids_of, is_static_cache, kv_shapes,
                              mark_prompt_dynamic, new_tokens, prefill_marks)

log = logging.getLogger("fx_fastprefill")

PREFILL, DECODE = "prefill", "decode"
HANDLE = "fx_fastprefill"  # the attribute the model carries while compiled for generate


class _NotPickled:
    """What ``compile_for_generate`` puts on a model holds compiled graphs and the backend: pickling
    the model (``pickle``, ``torch.save``) says what to do instead of failing deep inside them."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a model compiled by fx_fastprefill.compile_for_generate does not pickle (its forward "
                        "holds compiled graphs): call fx_fastprefill.restore(model) first, and compile_for_generate "
                        "again after loading")


class GenerateForward(_NotPickled):
    """The model's ``forward`` while it is compiled for generate: each call to the prefill or the
    decode path, counted (calls, and graphs compiled during them)."""

    def __init__(self, model: nn.Module, backend: FastPrefillBackend, decode_backend: str | Callable,
                 decode_dynamic: bool | None, precompile_folder: Path | None = None):
        self.model = model
        self.backend = backend
        self.original = model.forward  # the class's forward, bound
        functools.update_wrapper(self, self.original)  # transformers reads forward's signature
        self.prefill = torch.compile(self.original, backend=backend)
        on_cuda = next(model.parameters()).device.type == "cuda"
        mode = "reduce-overhead" if decode_backend == "inductor" and on_cuda else None
        self.decode_mode = mode
        self.static_decode = torch.compile(self.original, backend=decode_backend, mode=mode, dynamic=decode_dynamic)
        self.precompiled: dict[str, precompiled.PrecompiledFunction] = {}
        if precompile_folder is not None:
            self._precompile(Path(precompile_folder), backend, decode_backend, decode_dynamic)
        self.prompt_dynamic = True  # mark prompt-length dims dynamic before a prefill call
        self.kv_shapes: list[tuple[int, int]] | None = None  # per static cache layer, probed once
        self.calls: Counter[str] = Counter()
        self.compiles: Counter[str] = Counter()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = cache_of(kwargs)
        static = is_static_cache(cache)
        if new_tokens(args, kwargs) == 1 and cache is not None:
            path, run = DECODE, (self.static_decode if static else self.original)
        else:
            path, run = PREFILL, self.prefill
            if static:
                self._initialize(cache, args, kwargs)
            if self.prompt_dynamic and PREFILL not in self.precompiled:  # precompiled: marked while compiling
                mark_prompt_dynamic(args, kwargs)
        before = graphs_compiled()
        out = run(*args, **kwargs)
        self.calls[path] += 1
        self.compiles[path] += graphs_compiled() - before
        return out

    def _precompile(self, folder: Path, backend: FastPrefillBackend, decode_backend: str | Callable,
                    decode_dynamic: bool | None) -> None:
        """Both paths through functions saved in ``folder`` (compilation/precompiled.py), each with
        its ``torch.compile`` path as the fallback."""
        compiled_prefill = self.prefill

        def prefill_fallback(*args: Any, **kwargs: Any) -> Any:
            if self.prompt_dynamic:
                mark_prompt_dynamic(args, kwargs)
            return compiled_prefill(*args, **kwargs)

        def marks(args: tuple, kwargs: dict, functions: int) -> contextlib.AbstractContextManager:
            return prefill_marks(args, kwargs, functions, self.prompt_dynamic)

        common = dict(folder=folder, record_fallback=backend.fallbacks.record, hidden=INSTANCE_ATTRIBUTES,
                      prepare=clear_dim_marks)
        self.prefill = self.precompiled[PREFILL] = precompiled.PrecompiledFunction(
            self.original, name="prefill", options_key=str(backend.cache_tag), compile_options={"backend": backend},
            fallback=prefill_fallback, compile_context=marks, loader=backend.adopt_loaded,
            keyable=backend.cache_tag is not None, **common)
        options = torch_seams.mode_options(self.decode_mode, decode_dynamic) if self.decode_mode else {}
        self.static_decode = self.precompiled[DECODE] = precompiled.PrecompiledFunction(
            self.original, name="decode", options_key=repr((decode_backend, decode_dynamic, sorted(options.items()))),
            compile_options={"backend": decode_backend, "dynamic": decode_dynamic, "options": options},
            fallback=self.static_decode, keyable=isinstance(decode_backend, str), **common)

    def _kv_shapes(self, cache: Any) -> list[tuple[int, int]]:
        """:func:`kv_shapes`, kept next to the precompiled functions (under their key: the model's
        class, config and shapes) so that a warm start does not run the fake-tensor probe again."""
        function = self.precompiled.get(PREFILL)
        if function is None or function.failed:
            return kv_shapes(self.model, self.original, cache)
        path = function.folder / f"kv-shapes-{function.key}-{type(cache).__qualname__}.json"
        try:
            return [tuple(shape) for shape in json.loads(path.read_text())]
        except (FileNotFoundError, NotADirectoryError):  # not saved yet (or the folder is not one: written below)
            pass
        except (OSError, ValueError, TypeError) as e:  # unreadable or damaged: probed again, written anew
            self.backend.fallbacks.record(fallbacks.PRECOMPILE_FOLDER_FAILED)
            log.warning("precompiled: %s not read (%s: %s); the K/V shapes are probed again", path,
                        type(e).__name__, e)
        shapes = kv_shapes(self.model, self.original, cache)
        if shapes:
            try:
                precompiled.write_atomically(path, json.dumps(shapes).encode())
            except OSError as e:
                self.backend.fallbacks.record(fallbacks.PRECOMPILE_FOLDER_FAILED)
                log.warning("precompiled: %s not written (%s: %s); the next process probes the K/V shapes again",
                            path, type(e).__name__, e)
        return shapes

    def _initialize(self, cache: Any, args: tuple, kwargs: dict) -> None:
        """Allocate a static cache's tensors before the compiled prefill: allocated inside it (as
        transformers does on a layer's first update), they would not be marked as static addresses,
        and the decode CUDA graphs would copy the whole cache in and out at every step. Each layer
        gets the K/V shape the model writes (read off a fake-tensor probe, see :func:`kv_shapes`)."""
        layers = getattr(cache, "layers", [])
        if all(getattr(layer, "is_initialized", True) for layer in layers):
            return
        ids = input_ids_of(args, kwargs)
        batch = (ids if isinstance(ids, torch.Tensor) else kwargs["inputs_embeds"]).shape[0]
        if self.kv_shapes is None:
            self.kv_shapes = self._kv_shapes(cache)
        if not self.kv_shapes:
            if fallbacks.STATIC_CACHE_IN_PREFILL not in self.backend.fallbacks:
                log.warning("%s: %s", type(self.model).__name__, fallbacks.STATIC_CACHE_IN_PREFILL)
            self.backend.fallbacks.record(fallbacks.STATIC_CACHE_IN_PREFILL)
            return
        heads, head_dims = zip(*self.kv_shapes)
        cache.early_initialization(batch, list(heads), list(head_dims), dtype=self.model.dtype,
                                   device=self.model.device)


class GenerateCompilation(_NotPickled):
    """What ``compile_for_generate`` set up on a model (``model.fx_fastprefill``): the backend of the
    prefill graphs with its ``reports``, and per path the calls made and the graphs compiled."""

    def __init__(self, forward: GenerateForward, backend: FastPrefillBackend, saved_config: dict[str, Any],
                 arguments: dict[str, Any]):
        self.forward = forward
        self.backend = backend
        self.saved_config = saved_config
        self.arguments = arguments  # compile_for_generate's, for a deep copy of the model

    @property
    def reports(self):
        """The backend's reports: one per prefill graph it compiled."""
        return self.backend.reports

    @property
    def calls(self) -> dict[str, int]:
        return dict(self.forward.calls)

    @property
    def compiles(self) -> dict[str, int]:
        return dict(self.forward.compiles)

    def summary(self) -> str:
        cut = [r for r in self.reports if r.cut]
        lines = [
            f"calls: {self.calls.get(PREFILL, 0)} prefill, {self.calls.get(DECODE, 0)} decode; "
            f"graphs compiled: {self.compiles.get(PREFILL, 0)} prefill, {self.compiles.get(DECODE, 0)} decode "
            f"(decode mode: {self.forward.decode_mode or 'default'})",
            f"fx_fastprefill graphs: {len(self.reports)}, cut: {len(cut)}",
        ]
        lines += [f"  cut: {len(r.reduced_layers)} layers on the logits rows ({r.flops_removed_fraction:.0%} of "
                  f"prefill FLOPs removed)" for r in cut]
        lines += [f"  unchanged: {r.reason}" for r in self.reports if not r.cut]
        for path, function in self.forward.precompiled.items():
            lines.append(f"precompiled {path}: {function.state()}")
        return "\n".join(lines)


def _unwrap(model: nn.Module) -> nn.Module:
    if isinstance(getattr(model, "_orig_mod", None), nn.Module) and type(model).__name__ == "OptimizedModule":
        log.warning("compile_for_generate was given a torch.compile wrapper; it compiles the module inside it "
                    "(the wrapper's generate() would run that module uncompiled)")
        return model._orig_mod
    return model


def generating_model(model: nn.Module) -> nn.Module:
    """The transformers model whose ``forward`` ``model.generate`` calls: ``model`` itself, or the base
    model of a peft wrapper (its ``generate`` calls the base model's). Raises TypeError for any
    other module with a ``generate`` of its own: patching its forward would compile nothing that
    its ``generate`` runs."""
    from transformers import GenerationMixin
    get_base_model = getattr(model, "get_base_model", None)
    if not isinstance(model, GenerationMixin) and callable(get_base_model):
        base = get_base_model()
        if isinstance(base, GenerationMixin):
            return base  # peft: generate() runs the base model's generate(), hooks around it
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"{type(model).__name__}.generate is not transformers' generate: it may call another "
                        f"module's forward, which compile_for_generate would not compile. Pass the transformers "
                        f"model it wraps instead")
    return model


def compile_for_generate(model: nn.Module, *, backend: FastPrefillBackend | None = None,
                         cache_implementation: str | None = "static", decode_backend: str | Callable = "inductor",
                         decode_dynamic: bool | None = True, precompile: bool | str | os.PathLike = False,
                         **options: Any) -> nn.Module:
    """Compile a transformers causal LM so that its own ``model.generate(...)`` runs the prefill cut
    by the pass and the decode steps compiled; returns the model (patched in place; undo with
    :func:`restore`). A peft model is compiled through its base model, whose forward its
    ``generate`` runs (adapters unmerged or merged, switched with ``set_adapter``: Dynamo guards
    on their state); another wrapper with a ``generate`` of its own is refused.

    ``backend``: the FastPrefillBackend of the prefill graphs (default ``fx_fastprefill.backend(**options)``).
    ``cache_implementation``: what ``generate`` calls that choose no cache get (default
    ``"static"``: decode with CUDA graphs on CUDA; ``"dynamic"`` a DynamicCache; ``None`` the
    model's generation config decides). A call that passes a cache (``past_key_values=``), a
    ``cache_implementation`` or a ``generation_config`` goes through as it is.
    ``decode_backend``: the ``torch.compile`` backend of decode steps over a static cache
    (``"inductor"``: with ``mode="reduce-overhead"`` on CUDA).
    ``decode_dynamic``: their ``dynamic`` (True: one graph for every cache length, so a longer
    prompt, which makes transformers allocate a longer static cache, does not recompile).
    ``precompile``: save the compiled prefill and decode whole (Dynamo's trace included) and load
    them in the next process, which then starts without tracing or compiling
    (compilation/precompiled.py): True for a folder in Inductor's cache folder, or a folder of
    your own. Off by default: a saved function checks fewer of Dynamo's guards (the model's
    class, config and parameter shapes are checked through the file's key instead).
    """
    given = model = _unwrap(model)
    if not isinstance(model, nn.Module) or not callable(getattr(model, "generate", None)):
        raise TypeError(f"compile_for_generate needs a transformers model with a generate() method, "
                        f"got {type(model).__name__}")
    model = generating_model(model)
    if HANDLE in model.__dict__:
        raise RuntimeError(f"{type(model).__name__} is already compiled for generate; "
                           f"call fx_fastprefill.restore(model) first")
    if backend is None:
        backend = make_backend(**options)
    elif options:
        raise TypeError(f"options {sorted(options)} configure a new backend; with backend= given, set them on it")
    elif not isinstance(backend, FastPrefillBackend):
        raise TypeError(f"backend must be a FastPrefillBackend (fx_fastprefill.backend(...)), got {backend!r}")
    folder = precompiled.folder_for(precompile)
    if cache_implementation not in (None, "static", "dynamic"):
        raise ValueError(f"cache_implementation must be 'static', 'dynamic' or None, got {cache_implementation!r}")
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        log.warning("%s.forward takes no logits_to_keep: generate computes logits for every row and the prefill "
                    "graph cannot be cut", type(model).__name__)
    config = model.generation_config
    saved = {"disable_compile": getattr(config, "disable_compile", None)}
    # transformers would otherwise compile __call__ itself for a static cache, around this forward.
    config.disable_compile = True
    forward = GenerateForward(model, backend, decode_backend, decode_dynamic, folder)
    model.forward = forward
    model.generate = GenerateWithCache(model.generate, cache_implementation)
    arguments = dict(backend=backend, cache_implementation=cache_implementation, decode_backend=decode_backend,
                     decode_dynamic=decode_dynamic, precompile=folder or False)
    setattr(model, HANDLE, GenerateCompilation(forward, backend, saved, arguments))
    model.__deepcopy__ = functools.partial(_deepcopy_compiled, model)
    return given


INSTANCE_ATTRIBUTES = ("forward", "generate", HANDLE, "__deepcopy__")  # what compile_for_generate sets


def _deepcopy_compiled(model: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a model compiled for generate: the model copied without what
    compile_for_generate set on it, then compiled the same way (the same backend: its reports and
    fallbacks cover both models; its own calls and precompiled paths)."""
    handle = model.__dict__[HANDLE]
    with precompiled.without(model, INSTANCE_ATTRIBUTES):
        copied = copy.deepcopy(model, memo)
    for field, value in handle.saved_config.items():
        setattr(copied.generation_config, field, value)
    return compile_for_generate(copied, **handle.arguments)


class GenerateWithCache(_NotPickled):
    """The model's ``generate`` while compiled: asks for the cache implementation of
    :func:`compile_for_generate` on calls that name none. A call that passes a cache of its own (a
    chat continued from the last turn's cache), a ``cache_implementation`` or a ``generation_config``
    goes through as it is: transformers refuses a cache together with a cache implementation, so the
    choice is made per call, not written into the model's generation config."""

    def __init__(self, generate: Callable[..., Any], cache_implementation: str | None):
        self.original = generate
        self.cache_implementation = cache_implementation
        functools.update_wrapper(self, generate)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        chosen = cache_of(kwargs) is not None or kwargs.get("generation_config") is not None
        if _assisted(self.original.__self__, kwargs):
            # transformers (5.23) runs assisted generation on a DynamicCache only, and passes a
            # cache_implementation on to the assistant together with its cache (refused, uncompiled
            # too): the default cache, dynamic, is what runs. Verification steps (several tokens)
            # still go through the compiled prefill.
            if kwargs.get("cache_implementation") == "dynamic":
                del kwargs["cache_implementation"]
            return self.original(*args, **kwargs)
        if self.cache_implementation is not None and not chosen and "cache_implementation" not in kwargs:
            kwargs["cache_implementation"] = None if self.cache_implementation == "dynamic" else "static"
        return self.original(*args, **kwargs)


ASSISTED_OPTIONS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


def _assisted(model: nn.Module, kwargs: dict) -> bool:
    """The call is assisted generation (a draft model, prompt lookup, early exit), by transformers'
    own reading of the model's generation config with the call's options."""
    config = kwargs.get("generation_config") or model.generation_config
    try:
        from transformers.generation.configuration_utils import GenerationMode
        config = copy.copy(config)
        config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
        return config.get_generation_mode(kwargs.get("assistant_model")) == GenerationMode.ASSISTED_GENERATION
    except Exception:  # noqa: BLE001 - another transformers: its options, read by name
        return any(kwargs.get(k) is not None or getattr(config, k, None) not in (None, False) for k in ASSISTED_OPTIONS)


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`compile_for_generate`: the class's forward and the generation config as they were."""
    given, model = model, _unwrap(model)
    if isinstance(model, nn.Module) and HANDLE not in model.__dict__ and callable(getattr(model, "generate", None)):
        with contextlib.suppress(TypeError, ImportError):
            model = generating_model(model)
    handle = model.__dict__.get(HANDLE)
    if not isinstance(handle, GenerateCompilation):
        raise ValueError(f"{type(model).__name__} is not compiled for generate "
                         f"(fx_fastprefill.compile_for_generate was not called on it)")
    for name in INSTANCE_ATTRIBUTES:
        model.__dict__.pop(name, None)
    for field, value in handle.saved_config.items():
        setattr(model.generation_config, field, value)
    return given
