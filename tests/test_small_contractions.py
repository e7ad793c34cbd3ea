"""passes/small_contractions.py: mm / bmm over a few elements lowered as a multiply-sum, the same
values as the library's product; and the backend option that turns it off."""

import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fx_fastprefill
from fx_fastprefill.passes.small_contractions import MAX_CONTRACTION, MAX_ROWS, rewrite_small_contractions
from examples.gemma3n import Config, Gemma3nLike
from tests.helpers import random_prompts

aten = torch.ops.aten


def _traced(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_altup_mix_is_rewritten_with_the_same_values(dtype, tol):
    coefs, streams = torch.randn(4, 4, dtype=dtype), torch.randn(4, 7, 16, dtype=dtype)
    fn = lambda c, s: torch.einsum("st,tnd->snd", c, s) + 1  # noqa: E731
    gm = _traced(fn, coefs, streams)
    assert aten.bmm.default in _targets(gm)
    rewritten, count = rewrite_small_contractions(gm)
    assert count == 1 and aten.bmm.default not in _targets(rewritten)
    assert aten.bmm.default in _targets(gm)  # the graph given is left as it was
    torch.testing.assert_close(rewritten(coefs, streams), fn(coefs, streams), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # summed in float32, rounded once
        assert rewritten(coefs, streams).dtype == torch.bfloat16
        convert = torch.ops.prims.convert_element_type.default
        converts = [n.args[1] for n in rewritten.graph.nodes if n.target is convert]
        assert converts == [torch.float32, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("rows", [5, 40])  # summed row by row; broadcast and summed over the inner dim
def test_mm_with_a_small_inner_size_is_rewritten(rows):
    a, b = torch.randn(rows, 3), torch.randn(3, 11)
    rewritten, count = rewrite_small_contractions(_traced(torch.mm, a, b))
    assert count == 1 and aten.mm.default not in _targets(rewritten)
    assert (aten.sum.dim_IntList in _targets(rewritten)) == (rows > MAX_ROWS)
    torch.testing.assert_close(rewritten(a, b), a @ b)


@pytest.mark.parametrize("rows", [2, 12])
def test_a_batched_product_is_rewritten_per_batch(rows):
    a, b = torch.randn(3, rows, 4), torch.randn(3, 4, 9)
    rewritten, count = rewrite_small_contractions(_traced(torch.bmm, a, b))
    assert count == 1 and aten.bmm.default not in _targets(rewritten)
    torch.testing.assert_close(rewritten(a, b), torch.bmm(a, b))


@pytest.mark.parametrize("shapes", [
    ((5, MAX_CONTRACTION + 1), (MAX_CONTRACTION + 1, 11)),  # a contraction Inductor would not unroll
    ((5, 64), (64, 11)),
])
def test_larger_contractions_stay_library_calls(shapes):
    a, b = (torch.randn(s) for s in shapes)
    gm = _traced(torch.mm, a, b)
    rewritten, count = rewrite_small_contractions(gm)
    assert count == 0 and rewritten is gm


def test_a_symbolic_contraction_size_is_left_alone():
    a, b = torch.randn(5, 3), torch.randn(3, 11)
    gm = make_fx(torch.mm, tracing_mode="symbolic")(a, b)
    rewritten, count = rewrite_small_contractions(gm)
    assert count == 0 and rewritten is gm


@pytest.mark.parametrize("small_contractions", [True, False])
def test_gemma3n_altup_compiled_both_ways_matches_the_model(small_contractions, caplog):
    torch.manual_seed(1)
    model = Gemma3nLike(Config(n_layers=4, pattern=2, num_kv_shared_layers=2, sliding_window=6))
    prompts = random_prompts(3, 5, 30, model.cfg.vocab_size, seed=4)
    ref = fx_fastprefill.Runner(model, backend=None, max_model_len=64, max_num_tokens=48)
    backend = fx_fastprefill.backend(compiler="inductor", small_contractions=small_contractions)
    fast = fx_fastprefill.Runner(model, backend=backend, max_model_len=64, max_num_tokens=48)
    with caplog.at_level(logging.DEBUG, logger="fx_fastprefill"):
        torch.testing.assert_close(fast.prefill(prompts), ref.prefill(prompts), rtol=1e-4, atol=1e-4)
    assert backend.reports[-1].cut
    rewrote = [r for r in caplog.records if "small contractions" in r.getMessage()]
    assert bool(rewrote) == small_contractions


def test_the_option_is_checked_and_keys_the_program():
    with pytest.raises(TypeError, match="small_contractions must be a bool"):
        fx_fastprefill.backend(small_contractions="no")
    assert fx_fastprefill.backend().cache_tag != fx_fastprefill.backend(small_contractions=False).cache_tag
