"""``compile_for_generate``: transformers' own ``model.generate`` with the prefill cut by the pass
and the decode steps compiled. Tokens equal to the same model's uncompiled ``generate`` (fp32,
random weights, left-padded batches), greedy and sampled, with a static cache and a DynamicCache;
no graph compiled after the first prompt length; the prefill graph cut; ``restore`` undoes it all.

Decode graphs are compiled with ``decode_backend="eager"`` (Dynamo's graph run as is, no Inductor
on the CPU); the prefill regions with ``compiler="eager"``: what is checked is the dispatch, the
graphs the pass makes and that nothing recompiles."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

import fx_fastprefill  # noqa: E402
from examples.hf_check import left_padded_batch  # noqa: E402
from examples.hf_zoo import ARCHITECTURES  # noqa: E402
from fx_fastprefill import fallbacks  # noqa: E402
from fx_fastprefill.integrations.generate import DECODE, PREFILL  # noqa: E402

# Three prompt lengths (one graph must serve them all), all longer than the tiny Gemmas' sliding
# window (8): transformers takes another branch (another graph) for a prompt that fits in the window.
LENGTHS = [10, 14, 18]
# Gemma 3n with the static cache only (compile_for_generate's default): a DynamicCache leaves
# decode uncompiled, the same path for every model, checked on Gemma 4 and Llama.
# Mistral Large 4: CLA-style sharing of an MLA latent (its K and V of two widths: the static cache is
# made inside the prefill, counted).
CASES = [("gemma3n", "static"), ("gemma4_no_hand_slicing", "static"), ("gemma4", "dynamic"), ("llama", "static"),
         ("llama", "dynamic"), ("mistral_large4", "static")]


def _model(name: str):
    from examples.hf_zoo import missing
    if missing(name):
        pytest.skip(f"this transformers has no {missing(name)}")
    torch.manual_seed(0)
    return ARCHITECTURES[name][1]()


def _generate(model, lengths, cache: str, seed: int, sample: bool = False):
    ids, mask = left_padded_batch(lengths, model.config.get_text_config().vocab_size, pad_id=0, seed=seed)
    torch.manual_seed(seed)
    kwargs = dict(do_sample=True, top_k=0, temperature=1.0) if sample else dict(do_sample=False)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, pad_token_id=0,
                              cache_implementation=cache, **kwargs)


@pytest.mark.parametrize("name, cache", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_generate_matches_and_compiles_once(name, cache):
    model = _model(name)
    batches = [[n, max(2, n - 3)] for n in LENGTHS]
    expected = [_generate(model, lengths, cache, seed) for seed, lengths in enumerate(batches)]
    torch._dynamo.reset()
    fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
    handle = model.fx_fastprefill
    compiles_after_first = None
    for seed, (lengths, want) in enumerate(zip(batches, expected)):
        assert torch.equal(_generate(model, lengths, cache, seed), want), (seed, lengths)
        if compiles_after_first is None:
            compiles_after_first = handle.compiles
    assert handle.compiles == compiles_after_first, "a later prompt length recompiled"
    assert handle.compiles[PREFILL] == 1
    # Static cache: the decode graphs (Dynamo's first step, then the symbolic one); DynamicCache: uncompiled.
    assert (handle.compiles[DECODE] >= 1) if cache == "static" else (handle.compiles[DECODE] == 0)
    assert handle.calls == {PREFILL: len(LENGTHS), DECODE: 4 * len(LENGTHS)}
    prefill = handle.reports[0]
    assert prefill.cut, prefill.reason
    if name == "mistral_large4":
        assert handle.backend.fallbacks[fallbacks.STATIC_CACHE_IN_PREFILL] == len(LENGTHS)
    if name in ("gemma3n", "gemma4_no_hand_slicing", "mistral_large4"):  # the KV-shared layers on the logits rows
        assert set(prefill.eligible_layers) <= set(prefill.reduced_layers) and prefill.eligible_layers
    else:  # Llama: the last layer's queries; Gemma 4 slices its shared layers itself, the pass the layer before
        assert prefill.reduced_layers == ["model.layers.2.self_attn"]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_sampling_matches(cache):
    model = _model("llama")
    expected = _generate(model, [10, 6], cache, seed=5, sample=True)
    torch._dynamo.reset()
    fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
    assert torch.equal(_generate(model, [10, 6], cache, seed=5, sample=True), expected)
    assert model.fx_fastprefill.reports[0].cut


def test_restore_puts_everything_back():
    model = _model("llama")
    config_before = (model.generation_config.cache_implementation, model.generation_config.disable_compile)
    fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
    assert model.generation_config.cache_implementation == config_before[0]  # chosen per call, not written
    with pytest.raises(RuntimeError, match="already compiled for generate"):
        fx_fastprefill.compile_for_generate(model)
    handle = model.fx_fastprefill
    fx_fastprefill.restore(model)
    assert "forward" not in model.__dict__ and "generate" not in model.__dict__ and not hasattr(model, "fx_fastprefill")
    assert (model.generation_config.cache_implementation, model.generation_config.disable_compile) == config_before
    _generate(model, [6], "dynamic", seed=0)
    assert handle.calls == {}, "generate after restore went through the compiled forward"
    with pytest.raises(ValueError, match="not compiled for generate"):
        fx_fastprefill.restore(model)


def test_a_torch_compile_wrapper_is_unwrapped(caplog):
    """``torch.compile(model).generate()`` would run the module uncompiled: compile_for_generate
    compiles the module inside the wrapper, says so, and the wrapper's generate then runs it."""
    model = _model("llama")
    wrapper = torch.compile(model)
    with caplog.at_level(logging.WARNING, logger="fx_fastprefill"):
        compiled = fx_fastprefill.compile_for_generate(wrapper, compiler="eager", decode_backend="eager")
    assert compiled is model
    assert "torch.compile wrapper" in caplog.text
    _generate(wrapper, [6, 4], "static", seed=1)
    assert model.fx_fastprefill.calls[PREFILL] == 1


def test_bad_arguments_are_named():
    model = _model("llama")
    with pytest.raises(TypeError, match="configure a new backend"):
        fx_fastprefill.compile_for_generate(model, backend=fx_fastprefill.backend(), compiler="eager")
    with pytest.raises(ValueError, match="cache_implementation"):
        fx_fastprefill.compile_for_generate(model, cache_implementation="paged")
    with pytest.raises(TypeError, match="generate"):
        fx_fastprefill.compile_for_generate(torch.nn.Linear(2, 2))
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("name", ["llama", "gemma4_no_hand_slicing"])
def test_one_unpadded_prompt_with_a_static_cache_is_cut(name):
    """One prompt, no padding, a static cache. Gemma 4 then drops the mask and calls SDPA causal
    with the prompt's queries against every slot of the cache (top-left aligned): that call is cut
    too. Llama keeps an explicit mask (the same check, the other form)."""
    model = _model(name)
    expected = _generate(model, [13], "static", seed=7)
    torch._dynamo.reset()
    fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
    assert torch.equal(_generate(model, [13], "static", seed=7), expected)
    report = model.fx_fastprefill.reports[0]
    assert report.cut, report.reason


def _chat(model, cache_kind: str, seed: int):
    """Two turns of a chat, the second continuing from the first turn's cache (passed in both times)."""
    from transformers import DynamicCache, StaticCache
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    first, more = torch.randint(3, vocab, (1, 11), generator=gen), torch.randint(3, vocab, (1, 6), generator=gen)
    config = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=config) if cache_kind == "dynamic" else StaticCache(config=config, max_cache_len=48)
    with torch.no_grad():
        turn1 = model.generate(input_ids=first, past_key_values=cache, max_new_tokens=4, min_new_tokens=4,
                               do_sample=False, pad_token_id=0)
        turn2 = model.generate(input_ids=torch.cat([turn1, more], 1), past_key_values=cache, max_new_tokens=4,
                               min_new_tokens=4, do_sample=False, pad_token_id=0)
    return turn1, turn2


@pytest.mark.slow
@pytest.mark.parametrize("name, cache", [("llama", "dynamic"), ("llama", "static"), ("gemma3n", "dynamic")])
def test_a_cache_passed_in_continues_a_chat(name, cache):
    """generate(past_key_values=cache) twice, the second turn on the first turn's cache: the cache
    passed in wins over compile_for_generate's default (transformers refuses both), every prefill
    is cut, tokens equal the uncompiled model's."""
    model = _model(name)
    expected = _chat(model, cache, seed=3)
    torch._dynamo.reset()
    fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
    got = _chat(model, cache, seed=3)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    handle = model.fx_fastprefill
    assert handle.calls[PREFILL] == 2
    assert handle.reports and all(r.cut for r in handle.reports), [r.reason for r in handle.reports]


def _falcon(lying_config: bool):
    """Falcon's default attention: multi-query, one K/V head shared by 4 query heads.
    ``lying_config``: the config's num_key_value_heads says 4, as transformers 5.23's Falcon config
    did (it had no such field, and the cache took the attention head count)."""
    from examples.hf_zoo import _build
    torch.manual_seed(0)
    model = _build("FalconForCausalLM", "FalconConfig", vocab_size=96, hidden_size=32, num_hidden_layers=3,
                   num_attention_heads=4)()
    assert model.config.multi_query and not model.config.new_decoder_architecture
    if lying_config:
        model.config.num_key_value_heads = 4
    return model


@pytest.mark.parametrize("lying_config", [False, True], ids=["falcon", "falcon-config-says-4-kv-heads"])
def test_static_cache_of_a_one_kv_head_model(lying_config):
    """The static cache is sized by what the model writes (a fake-tensor probe of one token), not by
    the config: one K/V head here, whatever the config says."""
    model = _falcon(lying_config)
    expected = _generate(model, [10, 7], "static", seed=2)
    torch._dynamo.reset()
    fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
    assert torch.equal(_generate(model, [10, 7], "static", seed=2), expected)
    assert model.fx_fastprefill.forward.kv_shapes == [(1, 8)] * 3
    assert model.fx_fastprefill.reports[0].cut


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_kv_head_static_cache_on_the_gpu():
    """Falcon's one shared K/V head through the default path on CUDA: the probed static cache,
    Inductor prefill, decode with CUDA graphs; scores close to eager's, tokens equal."""
    model = _falcon(lying_config=True).cuda()
    ids = torch.randint(3, 96, (2, 12), device="cuda")

    def generate():
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                  pad_token_id=0, output_scores=True, return_dict_in_generate=True)

    expected = generate()
    fx_fastprefill.compile_for_generate(model)
    for _ in range(2):  # the second run replays the decode CUDA graphs
        got = generate()
        assert torch.equal(got.sequences, expected.sequences)
        for g, e in zip(got.scores, expected.scores):
            torch.testing.assert_close(g, e, rtol=2e-3, atol=2e-3)
    assert model.fx_fastprefill.forward.kv_shapes == [(1, 8)] * 3
    assert model.fx_fastprefill.reports[0].cut


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma4_no_hand_slicing", "llama"])
def test_new_batch_sizes_and_prompt_lengths_compile_nothing_after_two_prefill_graphs(name):
    """A first batch compiles a graph for its batch size; a second batch size, Dynamo's automatic
    dynamic shapes make the batch dim symbolic; from then on, batches of other sizes at other prompt
    lengths compile no new prefill graph, every one cut and equal to the uncompiled model."""
    model = _model(name)
    batches = [[10, 7], [14, 9, 12], [18, 11, 10, 16], [12, 15, 9, 11, 13]]
    expected = [_generate(model, lengths, "static", seed) for seed, lengths in enumerate(batches)]
    torch._dynamo.reset()
    fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
    handle = model.fx_fastprefill
    prefill_graphs = []
    for seed, (lengths, want) in enumerate(zip(batches, expected)):
        assert torch.equal(_generate(model, lengths, "static", seed), want), (seed, lengths)
        prefill_graphs.append(handle.compiles[PREFILL])
    assert prefill_graphs == [1, 2, 2, 2], prefill_graphs
    assert all(r.cut for r in handle.reports), [r.reason for r in handle.reports]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["draft model", "prompt lookup"])
def test_assisted_generation_runs_on_a_cache_it_supports(mode):
    """Issue 40, defect 4: transformers runs assisted generation on a DynamicCache only (5.23 refused
    the static cache compile_for_generate asks for by default). The call gets the dynamic cache;
    its prefill and the verification steps (several tokens each) go through the compiled, cut
    forward; tokens equal the uncompiled model's."""
    model = _model("gemma4_no_hand_slicing")
    vocab = model.config.get_text_config().vocab_size
    if mode == "draft model":
        import transformers
        torch.manual_seed(1)
        draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
        options = dict(assistant_model=draft)
    else:
        options = dict(prompt_lookup_num_tokens=3)
    ids = torch.randint(3, vocab, (1, 12))
    ids[0, 6:9] = ids[0, 1:4]  # something for prompt lookup to find
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, **options, **greedy)
        fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
        tokens = model.generate(input_ids=ids, **options, **greedy)
        # cache_implementation="dynamic" named in the call (transformers 5.23 refused it uncompiled too)
        again = model.generate(input_ids=ids, cache_implementation="dynamic", **options, **greedy)
    assert torch.equal(tokens, expected) and torch.equal(again, expected)
    handle = model.fx_fastprefill
    assert handle.calls[PREFILL] >= 2 and handle.reports and all(r.cut for r in handle.reports), handle.summary()


@pytest.mark.slow
def test_a_peft_model_is_compiled_through_its_base_model():
    """Issue 40, defect 5: ``peft_model.generate`` runs the base model's generate, which calls the base
    model's forward: that is the one compiled. LoRA adapters unmerged, switched and merged: tokens
    equal the uncompiled peft model's, the prefill cut, the compiled forward called."""
    peft = pytest.importorskip("peft")
    model = _model("llama")
    config = dict(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**config)).eval()
    wrapped.add_adapter("other", peft.LoraConfig(**config))
    ids, mask = left_padded_batch([10, 7], model.config.vocab_size, pad_id=0, seed=4)

    def generate():
        with torch.no_grad():
            return wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                    do_sample=False, pad_token_id=0, cache_implementation="static")
    states = []
    for adapter, merged in (("default", False), ("other", False), ("other", True)):
        wrapped.set_adapter(adapter)
        if merged:
            wrapped.merge_adapter()
        states.append(generate())
        if merged:
            wrapped.unmerge_adapter()
    torch._dynamo.reset()
    assert fx_fastprefill.compile_for_generate(wrapped, compiler="eager", decode_backend="eager") is wrapped
    for (adapter, merged), expected in zip((("default", False), ("other", False), ("other", True)), states):
        wrapped.set_adapter(adapter)
        if merged:
            wrapped.merge_adapter()
        assert torch.equal(generate(), expected), (adapter, merged)
        if merged:
            wrapped.unmerge_adapter()
    handle = wrapped.fx_fastprefill  # the base model's, through peft's attribute lookup
    assert handle.calls[PREFILL] == 3 and handle.reports and all(r.cut for r in handle.reports), handle.summary()
    assert not torch.equal(states[0], states[1])  # the adapters change the tokens (merging does not)
    fx_fastprefill.restore(wrapped)
    assert "forward" not in model.__dict__ and "fx_fastprefill" not in model.__dict__


def test_a_wrapper_whose_generate_would_bypass_the_compiled_forward_is_refused():
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def generate(self, *args, **kwargs):
            return self.inner.generate(*args, **kwargs)
    with pytest.raises(TypeError, match="is not transformers' generate"):
        fx_fastprefill.compile_for_generate(Wrapper(_model("llama")))


def test_a_deep_copy_is_compiled_and_pickling_says_to_restore_first():
    """Issue 40, defect 6: ``copy.deepcopy`` of a compiled model gives a model compiled the same way
    (its own forward, the same backend); ``pickle`` names ``restore``, after which it pickles."""
    import copy
    import pickle
    model = _model("gemma4_no_hand_slicing")
    expected = _generate(model, [10, 7], "static", seed=2)
    fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
    copied = copy.deepcopy(model)
    assert copied.fx_fastprefill is not model.fx_fastprefill and copied.forward.model is copied
    assert copied.fx_fastprefill.backend is model.fx_fastprefill.backend
    with torch.no_grad():
        copied.model.embed_tokens.weight.mul_(2)  # the copy's weights are its own
    assert torch.equal(_generate(model, [10, 7], "static", seed=2), expected)
    assert not torch.equal(_generate(copied, [10, 7], "static", seed=2), expected)
    assert copied.fx_fastprefill.calls[PREFILL] == 1 and model.fx_fastprefill.calls[PREFILL] == 1
    llama = _model("llama")  # (the tiny Gemma's hand-slicing switch is a lambda, which never pickles)
    expected = _generate(llama, [10, 7], "static", seed=2)
    fx_fastprefill.compile_for_generate(llama, compiler="eager", decode_backend="eager")
    for compiled in (llama, [llama]):
        with pytest.raises(TypeError, match=r"call fx_fastprefill.restore\(model\) first"):
            pickle.dumps(compiled)
    fx_fastprefill.restore(llama)
    assert torch.equal(_generate(pickle.loads(pickle.dumps(llama)), [10, 7], "static", seed=2), expected)
