"""``fx_fastprefill.attention``: causal attention over a packed variable-length batch with a KV cache.

The kernels of the ``attention`` and ``write_kv`` ops (schemas in ``ops/schema.py``). The op is
opaque to the compiler on purpose: the FX passes recognise it by handle, read the KV-sharing
relation from its ``layer`` / ``kv_source`` arguments, and rewrite it to its query-subset form
(``query_rows``) in the reduced region. Per-step batch layout comes from
:mod:`fx_fastprefill.ops.step_context`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from .step_context import WHOLE_STEP, current_step
from .kernels.decode import decode_attention
from .kernels.reference import prepare_kv, reference_attention, write_kv_rows
from .kernels.split_kv import HAS_TRITON, split_kv_attention
from .kernels.varlen import Kernel, flash_supported, flash_varlen_kernel, varlen_attention
from .schema import NAMESPACE


NO_BACKWARD = (
    "fx_fastprefill.attention has no backward: it writes and reads the step's KV cache, and a KV-sharing layer "
    "reads another layer's cache, which autograd cannot follow. Run the model under torch.no_grad() or "
    "torch.inference_mode() (fx_fastprefill.Runner does)"
)


@dataclass(frozen=True)
class AttentionKernels:
    """The kernels the attention op runs: the varlen kernel where ``varlen_supported(q)`` (else the
    float32 reference), and the split-KV kernel for few queries per request (None: varlen for all).
    Tests swap in emulations with :func:`use_kernels`."""
    varlen: Kernel
    split_kv: Callable | None
    varlen_supported: Callable[[Tensor], bool]


KERNELS = AttentionKernels(flash_varlen_kernel, split_kv_attention if HAS_TRITON else None, flash_supported)


@contextlib.contextmanager
def use_kernels(**kernels: Any) -> Iterator[AttentionKernels]:
    """Run the attention op with some kernels replaced (``varlen=``, ``split_kv=``, ``varlen_supported=``)."""
    global KERNELS
    previous = KERNELS
    KERNELS = dataclasses.replace(previous, **kernels)
    try:
        yield KERNELS
    finally:
        KERNELS = previous


def _check_arguments(q: Tensor, k: Tensor | None, v: Tensor | None, layer: str, kv_source: str | None,
                     sliding_window: int | None, query_rows: Tensor | None) -> None:
    """Shape and argument checks shared by the real and the fake implementation."""
    if not layer:
        raise ValueError("fx_fastprefill.attention: `layer` must be a non-empty name")
    if q.dim() != 3:
        raise ValueError(
            f"fx_fastprefill.attention(layer={layer!r}): q must be [tokens, heads, head_dim], got shape "
            f"{tuple(q.shape)}"
        )
    if (k is None) != (v is None):
        raise ValueError(f"fx_fastprefill.attention(layer={layer!r}): pass both k and v, or neither (with kv_source)")
    if k is None and kv_source is None:
        raise ValueError(
            f"fx_fastprefill.attention(layer={layer!r}): k and v are None, so kv_source must name the layer whose "
            "cache to read"
        )
    if kv_source is not None and kv_source == layer:
        raise ValueError(f"fx_fastprefill.attention(layer={layer!r}): kv_source names the layer itself")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(
            f"fx_fastprefill.attention(layer={layer!r}): sliding_window must be >= 1 or None, got {sliding_window}"
        )
    if k is not None:
        assert v is not None
        if k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                f"fx_fastprefill.attention(layer={layer!r}): k and v must be [tokens, kv_heads, head_dim], got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.shape[1] != v.shape[1]:
            raise ValueError(
                f"fx_fastprefill.attention(layer={layer!r}): k has {k.shape[1]} heads but v has {v.shape[1]}"
            )
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"fx_fastprefill.attention(layer={layer!r}{' reading ' + repr(kv_source) if kv_source else ''}): q "
                f"head_dim {q.shape[2]} != k head_dim {k.shape[2]}"
            )
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"fx_fastprefill.attention(layer={layer!r}{' reading ' + repr(kv_source) if kv_source else ''}): "
                f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
            )
    if query_rows is not None and (query_rows.dim() != 1 or query_rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"fx_fastprefill.attention(layer={layer!r}): query_rows must be a 1-D integer tensor")


def _require_step(layer: str):
    step = current_step()
    if step is None:
        raise RuntimeError(
            f"fx_fastprefill.attention(layer={layer!r}) was called outside a step: run the model through "
            "fx_fastprefill.Runner, or inside `with fx_fastprefill.step_context(meta):`"
        )
    return step


@torch.library.impl(f"{NAMESPACE}::write_kv", "CompositeExplicitAutograd")
def write_kv_op(k: Tensor, v: Tensor, layer: str) -> Tensor:
    """Write this step's K/V rows of ``layer`` to its cache; returns an empty token tensor.

    The passes split every cache write out of the attention call into this op, in the full region,
    and make the readers consume its token: the write always runs (even when the reduced region is
    skipped), and every read of the cache depends on it through the graph.
    """
    write_kv_rows(k, v, layer, _require_step(layer))
    return k.new_empty(0)


@torch.library.register_fake(f"{NAMESPACE}::write_kv")
def _write_kv_fake(k, v, layer):
    return k.new_empty(0)


@torch.library.impl(f"{NAMESPACE}::attention", "CompositeExplicitAutograd")
def attention_op(q: Tensor, k: Tensor | None, v: Tensor | None, layer: str, kv_source: str | None,
                 sliding_window: int | None, scale: float | None, query_rows: Tensor | None,
                 kv_written: Tensor | None) -> Tensor:
    _check_arguments(q, k, v, layer, kv_source, sliding_window, query_rows)
    step = _require_step(layer)
    keys, values = prepare_kv(q, k, v, layer, kv_source, kv_written is not None, step)
    kernels = KERNELS
    if step.graph_mode == WHOLE_STEP:  # inside a whole-step CUDA graph: the cache (its rows written) in place
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return decode_attention(q, keys, values, step.decode_rows, scale, sliding_window, step.kv_cache.region_len,
                                kernels.split_kv)
    if kernels.varlen_supported(q):
        out = varlen_attention(q, k, v, keys, values, sliding_window, scale, query_rows, step, kernels.varlen,
                               kernels.split_kv)
        if out is not None:
            return out
    return reference_attention(q, k, v, keys, values, sliding_window, scale, query_rows, step)


@torch.library.register_fake(f"{NAMESPACE}::attention")
def _attention_fake(q, k, v, layer, kv_source, sliding_window, scale, query_rows, kv_written):
    _check_arguments(q, k, v, layer, kv_source, sliding_window, query_rows)
    v_head_dim = v.shape[2] if v is not None else q.shape[2]
    return q.new_empty(q.shape[0], q.shape[1], v_head_dim)


def attention(q: Tensor, k: Tensor | None = None, v: Tensor | None = None, *, layer: str,
              kv_source: str | None = None, sliding_window: int | None = None,
              scale: float | None = None, query_rows: Tensor | None = None) -> Tensor:
    """Causal attention of a packed batch ``q [T, Hq, D]`` against this step's keys and the cache.

    A layer that computes its own K/V passes ``k, v [T, Hkv, D]``; they are written to its cache.
    A KV-sharing layer passes ``k=None, v=None, kv_source=<layer whose cache it reads>``.
    ``sliding_window=w`` lets a query see the ``w`` most recent positions, itself included.
    ``query_rows`` (a model split by hand) says which batch rows ``q`` holds: a suffix of each
    request's rows, e.g. ``logits_indices``; each query keeps its position.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
        raise RuntimeError(NO_BACKWARD)
    return torch.ops.fx_fastprefill.attention(q, k, v, layer, kv_source, sliding_window, scale, query_rows, None)


def _no_backward(ctx, *grads):
    raise RuntimeError(NO_BACKWARD)


# Called through torch.ops with inputs that require grad, the ops fail at backward with the reason
# (without a formula, autograd would warn once and return no gradient for them).
torch.library.register_autograd(f"{NAMESPACE}::attention", _no_backward)
torch.library.register_autograd(f"{NAMESPACE}::write_kv", _no_backward)

