"""Differential fuzzing on unmodified transformers models: random Gemma 3n, Gemma 4 and Llama-family
configs x random left-padded batches, compiled once with ``dynamic=True``, with and without the pass.

Profiles as in tests/test_fuzz.py, per family: ``ci`` (the default, one example each) and ``long``
(by hand, ten each: ``HYPOTHESIS_PROFILE=long pytest tests/test_fuzz_transformers.py``). Each example requires equal
logits on every batch, one compiled graph for all of them, the cut, the shared layers eligible
and reduced (Gemma), and the last layer reduced (dense models).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fx_fastprefill
from examples import hf_gemma3n, hf_gemma4
from examples.hf_check import left_padded_batch

pytest.importorskip("transformers")

settings.register_profile("ci", max_examples=1, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=10, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TYPES = ("sliding_attention", "full_attention")
VOCAB = 128


@st.composite
def gemma_configs(draw, family: str) -> dict:
    n = draw(st.integers(3, 6))
    shared = draw(st.integers(1, n - 2))
    types = [draw(st.sampled_from(TYPES)) for _ in range(n)]
    if family == "gemma4":
        types[-1] = "full_attention"  # Gemma 4 requires it (and would force it)
    for kind in set(types[n - shared:]):  # a shared layer reads the last earlier layer of its type
        if kind not in types[: n - shared]:
            types[draw(st.integers(0, n - shared - 1))] = kind
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    values = dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, num_hidden_layers=n,
                  num_kv_shared_layers=shared, layer_types=types, num_attention_heads=4, num_key_value_heads=kv_heads,
                  head_dim=draw(st.sampled_from([8, 16])), sliding_window=draw(st.integers(2, 8)))
    if family == "gemma3n":
        values["activation_sparsity_pattern"] = [0.0] * n
    else:
        values["global_head_dim"] = draw(st.sampled_from([16, 32]))
    return values


@st.composite
def llama_configs(draw) -> dict:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=draw(st.integers(1, 4)),
                  num_attention_heads=4, num_key_value_heads=draw(st.sampled_from([1, 2, 4])),
                  head_dim=draw(st.sampled_from([8, 16])), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    family = draw(st.sampled_from(["LlamaConfig", "MistralConfig", "Qwen3Config"]))
    if family == "MistralConfig":
        values["sliding_window"] = draw(st.integers(2, 8))
    return {"family": family, **values}


def build(family: str, values: dict) -> torch.nn.Module:
    if family == "gemma3n":
        return hf_gemma3n.tiny(**values)
    if family == "gemma4":
        return hf_gemma4.tiny(**values)
    import transformers
    config_name = values.pop("family")
    config = getattr(transformers, config_name)(**values)
    return getattr(transformers, config_name.replace("Config", "ForCausalLM"))._from_config(config).eval()


CONFIGS = {"gemma3n": gemma_configs("gemma3n"), "gemma4": gemma_configs("gemma4"), "llama": llama_configs()}
batches = st.lists(st.tuples(st.lists(st.integers(3, 14), min_size=2, max_size=3), st.integers(2, 4)),
                   min_size=1, max_size=3)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CONFIGS))  # one profile per family: each gets its examples
@given(data=st.data(), draws=batches, seed=st.integers(0, 2**16))
def test_random_transformers_models_and_batches_match_without_the_pass(family, data, draws, seed):
    values = data.draw(CONFIGS[family], label="config")
    layers = values["num_hidden_layers"]
    torch.manual_seed(seed)
    model = build(family, dict(values))
    backend = fx_fastprefill.backend(compiler="eager")
    torch._dynamo.reset()
    forward = torch.compile(model, backend=backend, dynamic=True)
    # The first batch has distinct sizes (batch 2, width 7, k 3): Dynamo keeps them apart, so one
    # graph serves every later batch, whatever its sizes.
    for b, (lengths, keep) in enumerate([([5, 7], 3), *draws]):
        ids, mask = left_padded_batch(lengths, VOCAB, pad_id=0, seed=seed + b)
        keep = min(keep, max(lengths) - 1)  # k of every row is Dynamo's own graph (and nothing to cut)
        with torch.no_grad():
            out = forward(input_ids=ids, attention_mask=mask, logits_to_keep=keep, use_cache=False).logits
            ref = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep, use_cache=False).logits
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert len(backend.reports) == 1, "a batch recompiled"
    report = backend.reports[0]
    assert report.cut, report.reason
    names = [f"model.layers.{i}.self_attn" for i in range(layers)]
    if family == "llama":
        assert report.eligible_layers == [] and report.reduced_layers == names[-1:]
    else:
        shared = names[layers - values["num_kv_shared_layers"]:]
        assert report.eligible_layers == shared
        assert set(shared) <= set(report.reduced_layers), report.reduced_layers


# Call forms a user reaches for that the pass was not designed around (issue "Correct or refused").
CALL_FORMS = ("grad", "cache_continued", "index_keep", "inputs_embeds", "generate_with_cache")


def _loss_and_grads(forward, model, call):
    logits = forward(**call).logits
    logits.float().square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _run_form(form, forward, model, ids, mask, keep, rows):
    """What ``forward`` returns for the call form (and the tensors to compare), run the same way
    for the compiled model and for the model itself."""
    from transformers import DynamicCache
    if form == "grad":
        return _loss_and_grads(forward, model, dict(input_ids=ids, attention_mask=mask, logits_to_keep=keep,
                                                    use_cache=False))
    with torch.no_grad():
        if form == "cache_continued":  # a prompt in two chunks, the second over the first one's cache
            cache, cut = DynamicCache(config=model.config.get_text_config(decoder=True)), ids.shape[1] // 2
            forward(input_ids=ids[:, :cut], attention_mask=mask[:, :cut], past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
            return forward(input_ids=ids[:, cut:], attention_mask=mask, past_key_values=cache, use_cache=True,
                           logits_to_keep=keep).logits
        if form == "index_keep":
            return forward(input_ids=ids, attention_mask=mask, logits_to_keep=rows, use_cache=False).logits
        if form == "inputs_embeds":
            embeds = model.get_input_embeddings()(ids)
            return forward(inputs_embeds=embeds, attention_mask=mask, logits_to_keep=keep, use_cache=False).logits
    raise ValueError(form)


def _chat(model, ids, extra):
    """generate twice on one DynamicCache passed in: the second turn continues the first."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with torch.no_grad():
        first = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=3, min_new_tokens=3,
                               do_sample=False, pad_token_id=0)
        return model.generate(input_ids=torch.cat([first, extra], 1), past_key_values=cache, max_new_tokens=3,
                              min_new_tokens=3, do_sample=False, pad_token_id=0)


@pytest.mark.slow
@pytest.mark.parametrize("form", CALL_FORMS)
@given(data=st.data(), lengths=st.lists(st.integers(6, 14), min_size=1, max_size=2), keep=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_random_call_forms_match_without_the_pass(form, data, lengths, keep, seed):
    """Random configs (Llama family, Gemma 3n, Gemma 4) called the ways users call them: autograd
    on (gradients equal, the graph uncut with the reason), a chunk continued on a cache, an index
    tensor as logits_to_keep, inputs_embeds, generate with a cache passed in. Every answer equals
    the model's own; every form but autograd is cut."""
    family = data.draw(st.sampled_from(sorted(CONFIGS)), label="family")
    values = data.draw(CONFIGS[family], label="config")
    torch.manual_seed(seed)
    model = build(family, dict(values))
    ids, mask = left_padded_batch(lengths, VOCAB, pad_id=0, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(-ids.shape[1], ids.shape[1], (data.draw(st.integers(1, 3), label="rows"),), generator=gen)
    torch._dynamo.reset()
    if form == "generate_with_cache":
        ids, extra = ids[:1, -lengths[0]:], torch.randint(3, VOCAB, (1, 4), generator=gen)
        expected = _chat(model, ids, extra)
        fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
        assert torch.equal(_chat(model, ids, extra), expected)
        reports = model.fx_fastprefill.reports
    else:
        backend = fx_fastprefill.backend(compiler="eager")
        compiled = torch.compile(model, backend=backend)
        got = _run_form(form, compiled, model, ids, mask, keep, rows)
        want = _run_form(form, model, model, ids, mask, keep, rows)
        for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            if isinstance(g, dict):
                assert g.keys() == w.keys()
                for name in w:  # NaN where the model's own gradient is NaN (a fully masked padded row)
                    torch.testing.assert_close(g[name], w[name], rtol=1e-4, atol=1e-5, equal_nan=True,
                                               msg=lambda m, name=name: f"{name}: {m}")
            else:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())
        reports = backend.reports
    assert reports
    if form == "grad":
        assert all(not r.cut and r.reason.startswith("autograd is on") for r in reports)
    elif form == "inputs_embeds" and family == "gemma4":
        # Gemma 4 recovers input_ids from the embeddings with nonzero(), a data-dependent shape:
        # Dynamo breaks the graph, the decoder and the logits slice land in different graphs, and
        # the decoder graph says so.
        assert any("a graph break left the row selection in another graph" in r.reason for r in reports)
    else:
        assert reports[-1].cut, reports[-1].reason
