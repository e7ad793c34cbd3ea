"""The transformers model zoo: unmodified causal LMs, tiny random-weight configs, compiled through the
backend the ways people write it; each form checked against eager transformers.

    python examples/hf_zoo.py                 # every architecture x every form, as a table
    python examples/hf_zoo.py llama gemma2    # some architectures
    python examples/hf_zoo.py --json zoo.json # the records as JSON
    python examples/hf_zoo.py --table zoo.json  # a saved run as a markdown table

A record says whether the graph that served the call was cut, which attention layers run on the
logits rows only, and the relative error of the logits against the same model without the pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

if not __package__:  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fx_fastprefill  # noqa: E402
from examples import hf_gemma3n, hf_gemma4  # noqa: E402
from examples.hf_check import left_padded_batch  # noqa: E402

VOCAB = 96
# Small sizes shared by the dense configs: 3 layers, GQA (4 query heads, 2 K/V heads of 8).
DENSE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)


def _build(class_name: str, config_name: str, **values) -> Callable[[], torch.nn.Module]:
    def build():
        import transformers
        config = getattr(transformers, config_name)(bos_token_id=1, eos_token_id=2, pad_token_id=0, **values)
        return getattr(transformers, class_name)._from_config(config).eval()
    build.needs = class_name
    return build


def missing(name: str) -> str | None:
    """The transformers class an architecture needs, where the installed transformers lacks it
    (families newer than the oldest release the package supports)."""
    import transformers
    needs = getattr(ARCHITECTURES[name][1], "needs", None)
    return needs if needs and not hasattr(transformers, needs) else None


def _mistral_large4(indexer_pattern: str) -> Callable[[], torch.nn.Module]:
    """Mistral Large 4's text model (MLA latents, a DSA top-k indexer, MoE) with CLA-style sharing:
    layers 2 and 3 attend to layer 1's latent cache; ``indexer_pattern`` says which layers run their
    own indexer (``F``) and which reuse the previous one's top-k (``S``). transformers has it only
    inside the multimodal class; a text-only call never runs the vision tower."""
    def build():
        import transformers
        text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                    num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16, qk_rope_head_dim=4,
                    qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2,
                    first_k_dense_replace=1, kv_source_layers=[0, 1, 1, 1], index_topk_pattern=indexer_pattern,
                    no_rope_layers=[1, 1, 1, 1], bos_token_id=1, eos_token_id=2, pad_token_id=0)
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                      image_size=32, patch_size=8)
        config = transformers.MistralLarge4Config(text_config=text, vision_config=vision)
        return transformers.MistralLarge4ForConditionalGeneration._from_config(config).eval()
    build.needs = "MistralLarge4ForConditionalGeneration"
    return build


def _gemma3n():
    return hf_gemma3n.tiny(**hf_gemma3n.SMALLEST)


def _gemma4(hand_slicing: bool, **overrides) -> Callable[[], torch.nn.Module]:
    return lambda: hf_gemma4.tiny(hand_slicing=hand_slicing, **{**hf_gemma4.SMALLEST, **overrides})


# name -> (what it exercises, builder)
ARCHITECTURES: dict[str, tuple[str, Callable[[], torch.nn.Module]]] = {
    "llama": ("dense, GQA", _build("LlamaForCausalLM", "LlamaConfig", **DENSE)),
    "mistral": ("sliding window", _build("MistralForCausalLM", "MistralConfig", **DENSE, sliding_window=4)),
    "qwen2": ("QKV bias", _build("Qwen2ForCausalLM", "Qwen2Config", **DENSE)),
    "qwen3": ("Q/K norms", _build("Qwen3ForCausalLM", "Qwen3Config", **DENSE, head_dim=8)),
    "gemma3": ("sliding and global layers", _build("Gemma3ForCausalLM", "Gemma3TextConfig", **DENSE, head_dim=8,
                                                   sliding_window=4, layer_types=["sliding_attention",
                                                                                  "full_attention"] * 1
                                                   + ["sliding_attention"])),
    "phi3": ("fused QKV and gate/up", _build("Phi3ForCausalLM", "Phi3Config", **DENSE)),
    "gpt_neox": ("fused QKV chunk, parallel residual",
                 _build("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=3, num_attention_heads=4)),
    "olmo2": ("norms after attention", _build("Olmo2ForCausalLM", "Olmo2Config", **DENSE)),
    "granite": ("scaled residuals and logits", _build("GraniteForCausalLM", "GraniteConfig", **DENSE)),
    "stablelm": ("partial rotary", _build("StableLmForCausalLM", "StableLmConfig", **DENSE)),
    "gpt2": ("learned positions, Conv1D QKV split",
             _build("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4)),
    "mixtral": ("MoE, sorted dispatch", _build("MixtralForCausalLM", "MixtralConfig", **DENSE, num_local_experts=4,
                                               num_experts_per_tok=2)),
    "qwen3_moe": ("MoE, sorted dispatch", _build("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **DENSE, head_dim=8,
                                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 decoder_sparse_step=1)),
    "gemma2": ("eager attention, softcaps",
               _build("Gemma2ForCausalLM", "Gemma2Config", **DENSE, head_dim=8, sliding_window=4)),
    "llama_eager": ("eager attention", _build("LlamaForCausalLM", "LlamaConfig", **DENSE,
                                              attn_implementation="eager")),
    "gemma3n": ("KV sharing, AltUp, per-layer inputs", _gemma3n),
    "gemma4": ("KV sharing, its own hand slicing", _gemma4(hand_slicing=True)),
    "gemma4_no_hand_slicing": ("KV sharing, the pass alone", _gemma4(hand_slicing=False)),
    "gemma4_moe": ("KV sharing, MoE block", _gemma4(hand_slicing=False, enable_moe_block=True, num_experts=4,
                                                    top_k_experts=2, moe_intermediate_size=32)),
    "gemma4_unified": ("KV sharing, Gemma 4 unified",
                       _build("Gemma4UnifiedForCausalLM", "Gemma4UnifiedTextConfig", vocab_size=VOCAB, hidden_size=32,
                              intermediate_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, sliding_window=4, num_kv_shared_layers=2,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention", "full_attention"])),
    "mistral_large4": ("CLA-style latent sharing, shared indexer, MLA, MoE", _mistral_large4("FFSS")),
    "mistral_large4_own_indexer": ("CLA-style latent sharing, each layer its own indexer", _mistral_large4("FFFF")),
    "deepseek_v3": ("MLA, MoE with grouped routing (gather, scatter)",
                    _build("DeepseekV3ForCausalLM", "DeepseekV3Config", vocab_size=VOCAB, hidden_size=32,
                           intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                           first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
                           qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)),
    "deepseek_v3_moe_last": ("MLA, MoE in the last layer, one routing group",
                             _build("DeepseekV3ForCausalLM", "DeepseekV3Config", vocab_size=VOCAB, hidden_size=32,
                                    intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                    num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                    n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
                                    qk_nope_head_dim=8, v_head_dim=8)),
    "llama4": ("MoE, every expert fed all rows (repeat)",
               _build("Llama4ForCausalLM", "Llama4TextConfig", **DENSE, head_dim=8, num_local_experts=4,
                      num_experts_per_tok=1, intermediate_size_mlp=64, interleave_moe_layer_step=1,
                      no_rope_layers=[1, 1, 0])),
    "bloom": ("ALiBi (baddbmm), eager attention",
              _build("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4)),
    "gpt_oss": ("attention sinks, MoE", _build("GptOssForCausalLM", "GptOssConfig", **DENSE, head_dim=8,
                                               num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                               layer_types=["sliding_attention", "full_attention",
                                                            "sliding_attention"])),
    "falcon": ("multi-query: one K/V head", _build("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB,
                                                   hidden_size=32, num_hidden_layers=3, num_attention_heads=4)),
}


@dataclass(frozen=True)
class Form:
    """One way of compiling and calling: the module or its ``forward``, ``dynamic`` as passed to
    torch.compile (None: the default, static shapes first), the prompt lengths of the batch
    (left-padded when several), and k."""
    name: str
    forward: bool
    dynamic: bool | None
    lengths: tuple[int, ...]
    keep: int
    warmup_keep: int | None = None  # a call with another k first: Dynamo then makes k a SymInt
    keep_index: tuple[int, ...] | None = None  # logits_to_keep as a 1-D index tensor of these rows instead of k

    def logits_to_keep(self) -> int | torch.Tensor:
        return torch.tensor(self.keep_index) if self.keep_index else self.keep


FORMS = {
    "module": Form("module (default shapes), k=1", False, None, (11,), 1),
    "module_k3_padded": Form("module, k=3, left-padded batch", False, None, (7, 12), 3),
    "dynamic": Form("forward, dynamic=True, k=1, left-padded", True, True, (9, 6, 12), 1),
    "dynamic_int_k": Form("forward, dynamic=True, int k=3, left-padded", True, True, (9, 12), 3, warmup_keep=2),
    "index_tensor": Form("module, k as index tensor [2, 5, -1], left-padded", False, None, (8, 11), 0,
                         keep_index=(2, 5, -1)),
}


@dataclass
class Record:
    architecture: str
    form: str
    cut: bool
    reduced_layers: int
    attention_layers: int
    relative_error: float
    reason: str
    seconds: float


def run_form(name: str, form: Form, compiler: str = "eager") -> Record:
    """Compile ``name`` as ``form`` says, call it, and compare with the model without the pass."""
    torch.manual_seed(0)
    if missing(name):
        raise RuntimeError(f"{name} needs transformers.{missing(name)}, which this transformers lacks")
    model = ARCHITECTURES[name][1]()
    vocab = model.config.get_text_config().vocab_size
    backend = fx_fastprefill.backend(compiler=compiler)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward if form.forward else model, backend=backend, dynamic=form.dynamic)
    ids, mask = left_padded_batch(list(form.lengths), vocab, pad_id=0, seed=len(name))
    start = time.perf_counter()
    with torch.no_grad():
        if form.warmup_keep is not None:
            compiled(input_ids=ids, attention_mask=mask, logits_to_keep=form.warmup_keep, use_cache=False)
        keep = form.logits_to_keep()
        out = compiled(input_ids=ids, attention_mask=mask, logits_to_keep=keep, use_cache=False).logits
        ref = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep, use_cache=False).logits
    seconds = time.perf_counter() - start
    error = ((out - ref).abs().max() / ref.abs().max()).item()
    report = backend.reports[-1]
    return Record(name, form.name, report.cut, len(report.reduced_layers), len(report.attention_layers), error,
                  report.reason, round(seconds, 1))


def markdown_table(records: list[dict]) -> str:
    """Architecture x form: cut, reduced / attention layers, relative error."""
    forms = list(dict.fromkeys(r["form"] for r in records))
    lines = ["| architecture | " + " | ".join(forms) + " |", "|---|" + "---|" * len(forms)]
    for name in dict.fromkeys(r["architecture"] for r in records):
        cells = []
        for form in forms:
            r = next((r for r in records if r["architecture"] == name and r["form"] == form), None)
            cells.append("" if r is None else f"{'cut' if r['cut'] else 'NOT CUT'} {r['reduced_layers']}/"
                         f"{r['attention_layers']}, {r['relative_error']:.1e}")
        lines.append(f"| {name} ({ARCHITECTURES[name][0]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("architectures", nargs="*", choices=[[], *ARCHITECTURES], default=[],
                        help="architectures to run (default: all)")
    parser.add_argument("--forms", nargs="*", choices=list(FORMS), default=list(FORMS))
    parser.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--json", help="write the records to this file")
    parser.add_argument("--table", metavar="JSON", help="print a saved run as a markdown table, and exit")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())["records"]))
        return
    records = []
    print(f"{'architecture':24} {'form':46} {'cut':4} {'reduced':>9} {'rel. error':>10} {'s':>6}")
    for name in args.architectures or ARCHITECTURES:
        if missing(name):
            print(f"{name:24} skipped: this transformers has no {missing(name)}", flush=True)
            continue
        for form in args.forms:
            r = run_form(name, FORMS[form], args.compiler)
            records.append(r)
            print(f"{name:24} {r.form:46} {'yes' if r.cut else 'NO':4} {r.reduced_layers:>4}/{r.attention_layers:<4} "
                  f"{r.relative_error:10.1e} {r.seconds:6.1f}" + ("" if r.cut else f"  {r.reason[:120]}"), flush=True)
    if args.json:
        meta = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
        Path(args.json).write_text(json.dumps({"meta": meta, "records": [asdict(r) for r in records]}, indent=1))


if __name__ == "__main__":
    main()
