"""``fx_fastprefill::sdpa``: the attention op of unmodified transformers models, made visible to the pass.

Transformers calls ``F.scaled_dot_product_attention``; by the time the graph is an aten graph that
call has become one of several backend-specific ops (flash for CPU, flash / efficient / cuDNN on
CUDA), each with its own signature. ``passes/capture_sdpa.py`` replaces the call, while the graph is
still Dynamo's, with this one op that names the layer it belongs to, so the KV-sharing analysis and
the cut see one canonical node per layer.

``query_suffix=True`` is the query-subset form: ``q`` holds the last ``Lq`` queries of sequences of
``Lk`` tokens, so causal masking is aligned bottom-right. SDPA's own ``is_causal`` is aligned
top-left; the two agree when ``Lq == Lk``. A model with a static cache calls it with more keys
than queries (the prompt's queries from position 0, the cache's every slot as keys), top-left
aligned: query ``i`` sees keys ``<= i``. Its suffix form is told how many queries the full call had
(``causal_queries``): its queries are the last ``Lq`` of those, aligned the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .schema import NAMESPACE


def _suffix_causal(num_q: int, of: int, num_k: int, device) -> Tensor:
    """The last ``num_q`` rows of ``of`` queries' top-left causal mask over ``num_k`` keys."""
    return torch.ones(num_q, num_k, dtype=torch.bool, device=device).tril(diagonal=of - num_q)


def _heads_inner(out: Tensor) -> Tensor:
    """``[B, H, L, D]`` laid out as ``[B, L, H, D]`` in memory: what the CUDA kernels return and what
    the fake kernel promises, so compiled code may rely on the strides. Copies only when needed."""
    if out.dim() != 4 or out.transpose(1, 2).is_contiguous():
        return out if out.dim() == 4 else out.contiguous()
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def sdpa_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
            scale: float | None, enable_gqa: bool, layer: str, query_suffix: bool,
            causal_queries: int | None = None) -> Tensor:
    num_q, num_k = q.shape[-2], k.shape[-2]
    of = num_k if causal_queries is None else causal_queries  # the full call's query count
    if query_suffix and num_q > of:
        raise ValueError(f"sdpa(layer={layer!r}): {num_q} suffix queries of only {of}")
    if is_causal and query_suffix and (num_q != num_k or of != num_k):
        causal = _suffix_causal(num_q, of, num_k, q.device)
        attn_mask = causal if attn_mask is None else _and_mask(attn_mask, causal, q.dtype)
        is_causal = False
    # Otherwise exactly what F.scaled_dot_product_attention does (top-left causal), as the model asked.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return _heads_inner(out)


torch.library.impl(f"{NAMESPACE}::sdpa", "CompositeExplicitAutograd")(sdpa_forward)


def _and_mask(mask: Tensor, causal: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf")).to(mask.dtype if mask.is_floating_point() else dtype)


def _sdpa_setup_context(ctx, inputs, output) -> None:
    q, k, v, attn_mask, dropout_p, *rest = inputs
    if dropout_p:
        raise RuntimeError("fx_fastprefill::sdpa has no backward with dropout (the backward would need the "
                           "forward's random mask); the backend leaves SDPA as it is when autograd is on")
    ctx.save_for_backward(q, k, v, attn_mask)
    ctx.rest = rest


def _sdpa_backward(ctx, grad: Tensor):
    """Recomputes the forward under autograd (F.scaled_dot_product_attention's own backward)."""
    saved = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(needs) if isinstance(t, Tensor) else t
              for t, needs in zip(saved, ctx.needs_input_grad)]
    with torch.enable_grad():
        out = sdpa_forward(*leaves[:3], leaves[3], 0.0, *ctx.rest)
        wanted = [t for t, needs in zip(leaves, ctx.needs_input_grad) if needs]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    return tuple(next(grads) if i < 4 and ctx.needs_input_grad[i] else None for i in range(len(ctx.needs_input_grad)))


torch.library.register_autograd(f"{NAMESPACE}::sdpa", _sdpa_backward, setup_context=_sdpa_setup_context)


@torch.library.register_fake(f"{NAMESPACE}::sdpa")
def _sdpa_fake(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, layer, query_suffix, causal_queries=None):
    if q.dim() == 4:
        batch, heads, num_q, _ = q.shape
        return q.new_empty(batch, num_q, heads, v.shape[-1]).transpose(1, 2)
    return q.new_empty(*q.shape[:-1], v.shape[-1])

