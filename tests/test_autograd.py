"""Autograd left on: gradients through the backend equal eager's, or the package refuses.

A graph that autograd differentiates is compiled the standard way (uncut, no package op in it) and
the report says why; the same model called under ``no_grad`` afterwards is recompiled and cut.
``fx_fastprefill::sdpa`` has a backward (recomputed through SDPA's own); the flat convention's
attention op reads the KV cache and refuses with a reason instead of returning no gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fx_fastprefill
from fx_fastprefill.compilation.backend import AUTOGRAD_REASON
from fx_fastprefill.fallbacks import AUTOGRAD
from fx_fastprefill.ops import sdpa as _sdpa_kernels  # noqa: F401  (the op's kernel and its autograd)
from fx_fastprefill.ops.attention import NO_BACKWARD

sdpa = torch.ops.fx_fastprefill.sdpa.default


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("name, compiler", [("llama", "inductor"), ("gemma3n", "eager"),
                                            ("gemma4_no_hand_slicing", "eager")])
def test_gradients_equal_eager_then_no_grad_is_cut(name, compiler):
    pytest.importorskip("transformers")
    from examples.hf_zoo import ARCHITECTURES
    torch.manual_seed(0)
    model = ARCHITECTURES[name][1]()
    vocab = model.config.get_text_config().vocab_size
    ids, target = torch.randint(3, vocab, (2, 12)), torch.randint(3, vocab, (2, 3))
    _loss(model(input_ids=ids, logits_to_keep=3, use_cache=False).logits, target).backward()
    expected = _grads(model)
    backend = fx_fastprefill.backend(compiler=compiler)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    _loss(compiled(input_ids=ids, logits_to_keep=3, use_cache=False).logits, target).backward()
    got = _grads(model)
    assert got.keys() == expected.keys()
    for param, grad in expected.items():
        torch.testing.assert_close(got[param], grad, rtol=1e-4, atol=1e-5, msg=param)
    report = backend.reports[-1]
    assert not report.cut and report.reason == AUTOGRAD_REASON
    assert report.fallbacks == {AUTOGRAD: 1} and backend.fallbacks[AUTOGRAD] == 1
    # Grad mode is guarded: the same compiled model under no_grad gets a graph of its own, cut.
    with torch.no_grad():
        logits = compiled(input_ids=ids, logits_to_keep=3, use_cache=False).logits
        ref = model(input_ids=ids, logits_to_keep=3, use_cache=False).logits
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
    assert backend.reports[-1].cut, backend.reports[-1].reason


def test_parameters_frozen_is_cut_with_grad_mode_on():
    """Grad mode on but nothing requires grad: no backward to build, so the graph is cut."""
    pytest.importorskip("transformers")
    from examples.hf_zoo import ARCHITECTURES
    torch.manual_seed(0)
    model = ARCHITECTURES["llama"][1]().requires_grad_(False)
    ids = torch.randint(3, 90, (1, 9))
    backend = fx_fastprefill.backend(compiler="eager")
    torch._dynamo.reset()
    logits = torch.compile(model, backend=backend)(input_ids=ids, logits_to_keep=1, use_cache=False).logits
    torch.testing.assert_close(logits, model(input_ids=ids, logits_to_keep=1, use_cache=False).logits)
    assert backend.reports[-1].cut


SDPA_CASES = {
    # name: (q rows, keys, is_causal, query_suffix, causal_queries, mask)
    "plain causal": (6, 6, True, False, None, False),
    "suffix causal": (2, 6, True, True, None, False),
    "suffix of top-left causal over a static cache": (2, 9, True, True, 6, False),
    "suffix with a mask": (3, 6, False, True, None, True),
}


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_op_gradients(case):
    """Gradcheck in float64, and the gradients equal SDPA's own on the full call's last rows."""
    rows, keys, is_causal, suffix, causal_queries, with_mask = SDPA_CASES[case]
    torch.manual_seed(0)
    q = torch.randn(1, 4, rows, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, keys, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.randn(1, 1, rows, keys, dtype=torch.float64) if with_mask else None
    args = (0.0, is_causal, None, True, "layer", suffix, causal_queries)
    torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, mask, *args), (q, k, v))
    out = sdpa(q, k, v, mask, *args)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    # The same rows of the full call, through F.scaled_dot_product_attention's own backward.
    of = causal_queries or keys
    q_full = torch.cat([torch.randn(1, 4, of - rows, 8, dtype=torch.float64), q.detach()], 2).requires_grad_()
    k2, v2 = k.detach().requires_grad_(), v.detach().requires_grad_()
    if with_mask:
        full_mask = torch.cat([torch.zeros(1, 1, of - rows, keys, dtype=torch.float64), mask], 2)
        full = F.scaled_dot_product_attention(q_full, k2, v2, attn_mask=full_mask, enable_gqa=True)
    else:
        full = F.scaled_dot_product_attention(q_full, k2, v2, is_causal=is_causal, enable_gqa=True)
    ref = torch.autograd.grad(full[:, :, -rows:].square().sum(), (q_full, k2, v2))
    torch.testing.assert_close(grads[0], ref[0][:, :, -rows:])
    torch.testing.assert_close(grads[1:], ref[1:])


def test_sdpa_op_refuses_backward_with_dropout():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="no backward with dropout"):
        sdpa(q, k, v, None, 0.1, True, None, False, "layer", False)


def test_flat_attention_refuses_autograd_eager_and_compiled():
    """The flat convention's op reads the KV cache: with autograd on it says so, before running."""
    from examples.gemma3n import tiny
    model = tiny()
    ids, positions, rows = torch.randint(0, 100, (10,)), torch.arange(10), torch.tensor([9])
    with pytest.raises(RuntimeError, match="has no backward"):
        model(ids, positions, rows)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="has no backward"):
        torch.compile(model, backend=fx_fastprefill.backend(compiler="eager"))(ids, positions, rows)
    q = torch.randn(4, 2, 8, requires_grad=True)
    with pytest.raises(RuntimeError) as error:
        fx_fastprefill.attention(q, q.detach(), q.detach(), layer="a")
    assert str(error.value) == NO_BACKWARD


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gradients_on_the_gpu_with_inductor():
    """The standard compile path on CUDA (Inductor's forward and backward kernels), then the cut
    graph under no_grad, against eager on the same device."""
    pytest.importorskip("transformers")
    from examples.hf_zoo import ARCHITECTURES
    torch.manual_seed(0)
    model = ARCHITECTURES["gemma4_no_hand_slicing"][1]().cuda()
    ids, target = torch.randint(3, 200, (2, 16), device="cuda"), torch.randint(3, 200, (2, 2), device="cuda")
    _loss(model(input_ids=ids, logits_to_keep=2, use_cache=False).logits, target).backward()
    expected = _grads(model)
    backend = fx_fastprefill.backend()
    compiled = torch.compile(model, backend=backend)
    _loss(compiled(input_ids=ids, logits_to_keep=2, use_cache=False).logits, target).backward()
    got = _grads(model)
    assert got.keys() == expected.keys()
    for param, grad in expected.items():
        torch.testing.assert_close(got[param], grad, rtol=2e-3, atol=2e-4, msg=param)  # tf32 / fused kernels
    assert backend.reports[-1].reason == AUTOGRAD_REASON
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, logits_to_keep=2, use_cache=False).logits,
                                   model(input_ids=ids, logits_to_keep=2, use_cache=False).logits,
                                   rtol=2e-3, atol=2e-3)
    assert backend.reports[-1].cut
