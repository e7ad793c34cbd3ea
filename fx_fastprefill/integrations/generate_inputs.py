"""What a ``generate`` call hands the model's forward, read and marked for the compiled paths:
its inputs and cache, the prompt-length (and batch) dims marked dynamic for the prefill graph, and
the K/V shapes of a static cache read off a fake-tensor probe (so that the cache can be allocated
outside the compiled prefill). Used by integrations/generate.py."""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .. import torch_seams

log = logging.getLogger("fx_fastprefill")

def graphs_compiled() -> int:
    """Dynamo's count of graphs compiled in this process (any backend): the difference around a
    call is what that call compiled."""
    return torch_seams.graphs_compiled()


def input_ids_of(args: tuple, kwargs: dict) -> Any:
    return kwargs.get("input_ids", args[0] if args else None)


def new_tokens(args: tuple, kwargs: dict) -> int | None:
    """Tokens per sequence in this call (``input_ids`` or ``inputs_embeds``); None if neither."""
    ids = input_ids_of(args, kwargs)
    if isinstance(ids, torch.Tensor):
        return ids.shape[-1]
    embeds = kwargs.get("inputs_embeds")
    return embeds.shape[-2] if isinstance(embeds, torch.Tensor) else None


def cache_of(kwargs: dict) -> Any:
    """The cache argument: ``past_key_values`` (transformers <= 5.24), ``cache`` (5.25)."""
    cache = kwargs.get("past_key_values")
    return kwargs.get("cache") if cache is None else cache


def _cache_argument(forward: Callable[..., Any]) -> str:
    """The name a forward takes its cache by: ``cache`` (transformers 5.25 on), ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def mark_prompt_dynamic(args: tuple, kwargs: dict) -> None:
    """Mark the prompt-length dims of a prefill call's inputs dynamic (and a static cache's length),
    the batch and everything else static: one graph for every prompt length, without
    ``dynamic=True``'s symbols for every dim and int (slower to trace, and it retraces once to
    specialize float scalars)."""
    mark = torch_seams.maybe_mark_dynamic
    for name, tensor in (("input_ids", input_ids_of(args, kwargs)), ("position_ids", kwargs.get("position_ids")),
                         ("inputs_embeds", kwargs.get("inputs_embeds"))):
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
            mark(tensor, tensor.dim() - (2 if name == "inputs_embeds" else 1))
    masks = kwargs.get("attention_mask")
    for mask in masks.values() if isinstance(masks, dict) else [masks]:
        if isinstance(mask, torch.Tensor):
            for dim in range(1, mask.dim()) if mask.dim() == 2 else (mask.dim() - 2, mask.dim() - 1):
                mark(mask, dim)
    for layer in getattr(cache_of(kwargs), "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 4:
                mark(tensor, 2)


def _marked_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors of a prefill call whose dims the marks below make dynamic."""
    masks = kwargs.get("attention_mask")
    tensors = [input_ids_of(args, kwargs), kwargs.get("position_ids"), kwargs.get("inputs_embeds"),
               *(masks.values() if isinstance(masks, dict) else [masks])]
    for layer in getattr(cache_of(kwargs), "layers", []):
        tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def mark_batch_dynamic(args: tuple, kwargs: dict) -> None:
    """Mark the batch dims of a prefill call's inputs dynamic too: what Dynamo's automatic dynamic
    does for a second graph, done before a second precompiled one (a batch of 1 stays specialized)."""
    for tensor in _marked_tensors(args, kwargs):
        if tensor.dim() >= 2:
            torch_seams.maybe_mark_dynamic(tensor, 0)


DIM_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
             "_dynamo_strict_unbacked_indices", "_dynamo_static_indices", "_has_dynamo_dim_marking")


def clear_dim_marks(args: tuple, kwargs: dict) -> None:
    """Take Dynamo's dim marks off a call's tensors. A precompiled function's guards, loaded from a
    file, expect unmarked tensors (torch saves the compile-time tensors without their marks), so the
    precompiled paths mark only while compiling and clear the marks before every guard check."""
    for tensor in _marked_tensors(args, kwargs):
        for mark in DIM_MARKS:
            tensor.__dict__.pop(mark, None)


@contextlib.contextmanager
def prefill_marks(args: tuple, kwargs: dict, functions: int, prompt_dynamic: bool) -> Iterator[None]:
    """While a precompiled prefill compiles: the prompt dims dynamic, the batch dims too after the
    first function (an automatic-dynamic second graph)."""
    if prompt_dynamic:
        mark_prompt_dynamic(args, kwargs)
        if functions:
            mark_batch_dynamic(args, kwargs)
    try:
        yield
    finally:
        clear_dim_marks(args, kwargs)


def is_static_cache(cache: Any) -> bool:
    """A cache of fixed-size tensors updated in place (transformers' StaticCache and kin)."""
    from transformers import DynamicCache
    return bool(getattr(cache, "is_compileable", False)) and not isinstance(cache, DynamicCache)


def kv_shapes(model: nn.Module, forward: Callable[..., Any], cache: Any) -> list[tuple[int, int]]:
    """Per cache layer, the (K/V heads, head dim) the model writes to a static cache like ``cache``;
    [] where they cannot be known (K and V of different sizes, or the probe failed).

    The model's ``forward`` (uncompiled) runs once on fake tensors (no memory, no compute) with one
    token over a fresh copy of the cache, and each layer's lazily made tensors are read: the shapes
    transformers itself would allocate, for every model (Falcon's one shared K/V head whatever its
    config says, per-layer head dims), where a config-derived shape can be wrong. Module state the
    forward sets (a rotary cache, say) is put back as it was, so no fake tensor stays behind."""
    probe = copy.deepcopy(cache)
    state = [(module, dict(module.__dict__), dict(module._buffers)) for module in model.modules()]
    try:
        with torch_seams.fake_tensor_mode(allow_non_fake_inputs=True), torch.no_grad():
            ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
            forward(input_ids=ids, use_cache=True, logits_to_keep=1, **{_cache_argument(forward): probe})
    except Exception as e:  # noqa: BLE001 - the shapes are then unknown: the cache is made in the prefill
        log.warning("probing the K/V shapes of %s failed (%s: %s)", type(model).__name__, type(e).__name__, e)
        return []
    finally:
        for module, attributes, buffers in state:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            module._buffers.clear()
            module._buffers.update(buffers)
    shapes = []
    for layer in probe.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not getattr(layer, "supports_early_init", True) or keys is None:
            shapes.append((1, 1))  # a layer early initialization skips (a KV-shared layer's placeholder)
        elif keys.shape[1] != values.shape[1] or keys.shape[-1] != values.shape[-1]:
            return []  # early_initialization makes K and V of one shape
        else:
            shapes.append((keys.shape[1], keys.shape[-1]))
    return shapes
