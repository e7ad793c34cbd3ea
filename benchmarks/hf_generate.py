"""transformers ``generate`` end to end on the GPU: time to the first token and per decode token,
every variant in the same run, random bf16 weights, greedy, left-padded batches of equal prompts.

Variants:
- ``eager``: ``model.generate`` uncompiled (DynamicCache);
- ``hf_static``: transformers' documented fast path, ``cache_implementation="static"``: it
  compiles the decode step itself (``torch.compile(mode="reduce-overhead")``), the prefill eager;
- ``compiled``: the prefill compiled by ``torch.compile`` with static shapes (its best case, one
  compile per prompt shape) and the decode as ``ffp``'s: the strongest baseline without the pass;
- ``hand_slicing`` (Gemma 4): ``compiled`` with transformers' own slicing of the KV-shared layers'
  inputs on (the other variants run with it off);
- ``ffp``: ``fx_fastprefill.compile_for_generate(model)``.

Per record: ``ttft_ms`` (median wall time of ``generate(max_new_tokens=1)``: prefill and the first
token), ``decode_ms_per_token`` (median over pairs of (``generate`` of N tokens - TTFT) / (N - 1)),
``first_generate_s`` (the first call of the variant in this process at that shape, compiles
included, with Inductor's cache as earlier variants left it: the decode graphs of ``compiled`` and
``ffp`` are the same), the first token and the relative error of its logits against ``eager`` and
``compiled``. Each variant is set up once and runs every shape (``ffp`` compiles one prefill graph
for every prompt length; ``compiled`` one per shape). Compile time in fresh processes, cold and
warm: benchmarks/compile_time.py.

    PYTHONPATH=. python3 benchmarks/hf_generate.py --model gemma3n-e2b --out generate.json
    python3 benchmarks/hf_generate.py --smoke --out /tmp/g.json     # CPU, tiny model: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fx_fastprefill  # noqa: E402
from benchmarks.hf_prefill import gemma3n_e2b, gemma4_default_shared12, set_hand_slicing  # noqa: E402
from examples import hf_gemma4  # noqa: E402
from examples.hf_check import left_padded_batch  # noqa: E402


def gemma4_e2b():
    """A Gemma-4-E2B-like text shape: 35 layers, the last 20 reading earlier layers' K/V, hidden
    1536, one K/V head, 256-wide sliding and 512-wide global heads, 4 sliding layers to 1 global."""
    from transformers import Gemma4TextConfig
    layers = 35
    return Gemma4TextConfig(num_hidden_layers=layers, num_kv_shared_layers=20, hidden_size=1536,
                            intermediate_size=6144, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                            global_head_dim=512, use_double_wide_mlp=True,
                            layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * (layers // 5))


CONFIGS = {"gemma3n-e2b": gemma3n_e2b, "gemma4-e2b": gemma4_e2b, "gemma4-default": gemma4_default_shared12}


def build(name: str, device: str):
    torch.manual_seed(0)
    with torch.device(device):
        if name == "tiny":
            return hf_gemma4.tiny(hand_slicing=True)
        if name.startswith("gemma3n"):
            from transformers import Gemma3nForCausalLM
            return Gemma3nForCausalLM(CONFIGS[name]()).eval()
        from transformers import Gemma4ForCausalLM
        return Gemma4ForCausalLM(CONFIGS[name]()).eval()


def prepare(model, variant: str, cuda: bool):
    """The model set up for ``variant``; returns the generate kwargs it needs."""
    if type(model).__name__.startswith("Gemma4"):
        set_hand_slicing(model, variant == "hand_slicing")
    if variant == "eager":
        return {"cache_implementation": None}
    if variant == "hf_static":
        return {"cache_implementation": "static"}
    options = {} if cuda else {"compiler": "eager"}
    fx_fastprefill.compile_for_generate(model, decode_backend="inductor" if cuda else "eager", **options)
    if variant in ("compiled", "hand_slicing"):
        forward = model.forward
        forward.prefill = torch.compile(forward.original, dynamic=False)
        forward.prompt_dynamic = False
    return {}


def unprepare(model) -> None:
    if "fx_fastprefill" in vars(model):
        fx_fastprefill.restore(model)
    torch._dynamo.reset()


def timed_generate(model, ids, mask, new_tokens: int, cuda: bool, **kwargs) -> tuple[float, torch.Tensor]:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma3n-e2b", choices=[*CONFIGS, "tiny"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="1x8192,8x2048")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--variants", default="")
    parser.add_argument("--ttft-only", action="store_true",
                        help="time generate(max_new_tokens=1) only: no decode step runs, none is compiled")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny shapes, 2 runs: the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.shapes, args.runs, args.new_tokens = "tiny", "1x24,2x16", 2, 4
    cuda = not args.smoke
    device = "cuda" if cuda else "cpu"
    variants = ["eager", "hf_static", "compiled", "ffp"]
    if args.model.startswith("gemma4"):
        variants.insert(3, "hand_slicing")
    if args.variants:
        variants = args.variants.split(",")
    import transformers
    model = build(args.model, device)
    if cuda:
        model.to(torch.bfloat16)
    cfg = model.config
    shared = cfg.num_kv_shared_layers
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    batches = {shape: left_padded_batch([shape[1]] * shape[0], cfg.vocab_size, pad_id=0, seed=shape[0] * shape[1])
               for shape in shapes}
    records, firsts = [], {}
    for variant in variants:  # one set-up per variant: its compiled graphs serve every shape
        try:
            kwargs = prepare(model, variant, cuda)
        except Exception:  # noqa: BLE001 - recorded; the other variants still run
            records.append({"model": f"{args.model}-hf", "variant": variant, "error": traceback.format_exc(limit=8)})
            unprepare(model)
            continue
        for batch, seq_len in shapes:
            ids, mask = (t.to(device) for t in batches[(batch, seq_len)])
            record = {"model": f"{args.model}-hf", "batch": batch, "seq_len": seq_len, "variant": variant,
                      "layers": cfg.num_hidden_layers, "shared_layers": shared,
                      "ideal_prefill_speedup": cfg.num_hidden_layers / (cfg.num_hidden_layers - shared),
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "device": torch.cuda.get_device_name() if cuda else "cpu"}
            try:
                measure(model, ids, mask, args, cuda, kwargs, record)
                first = first_token(model, ids, mask, kwargs)
                compare(record, first, firsts, (batch, seq_len))
                firsts[(batch, seq_len, variant)] = first
                handle = vars(model).get("fx_fastprefill")
                if handle is not None:
                    record.update(calls=handle.calls, compiles=handle.compiles,
                                  cut=[r.cut for r in handle.reports], reasons=[r.reason for r in handle.reports],
                                  reduced_layers=[len(r.reduced_layers) for r in handle.reports])
                if cuda:
                    record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            except Exception:  # noqa: BLE001 - recorded; the other shapes and variants still run
                record["error"] = traceback.format_exc(limit=8)
            print(json.dumps({k: v for k, v in record.items() if not k.endswith("times_ms")}), flush=True)
            records.append(record)
            Path(args.out).write_text(json.dumps(records, indent=1))
        unprepare(model)
        if cuda:
            torch.cuda.empty_cache()


def measure(model, ids, mask, args, cuda: bool, kwargs: dict, record: dict) -> None:
    """TTFT and decode ms/token. Decode is timed in pairs: generate(1) and generate(N) back to back,
    their difference over N - 1 steps, the median over the pairs (drift cancels within a pair)."""
    new_tokens = 1 if args.ttft_only else args.new_tokens
    record["new_tokens"] = new_tokens
    record["first_generate_s"] = timed_generate(model, ids, mask, new_tokens, cuda, **kwargs)[0] / 1e3
    timed_generate(model, ids, mask, 1, cuda, **kwargs)  # a 1-token generate compiles nothing new
    first, full = [], []
    for _ in range(args.runs):
        first.append(timed_generate(model, ids, mask, 1, cuda, **kwargs)[0])
        if not args.ttft_only:
            full.append(timed_generate(model, ids, mask, new_tokens, cuda, **kwargs)[0])
    record.update(ttft_ms=statistics.median(first), ttft_times_ms=first)
    if full:
        per_token = [(f - t) / (new_tokens - 1) for f, t in zip(full, first)]
        record.update(generate_times_ms=full, decode_ms_per_token=statistics.median(per_token),
                      decode_times_ms=per_token)


def first_token(model, ids, mask, kwargs: dict) -> dict:
    """The first generated token and the logits it came from (untimed)."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True, **kwargs)
    return {"token": out.sequences[:, -1].cpu(), "logits": out.logits[0].float().cpu()}


def compare(record: dict, first: dict, firsts: dict, shape: tuple) -> None:
    """The first token and its logits against the variants run before (bf16: the logits' relative
    error shows whether a token that differs is a near tie or a wrong result)."""
    for reference in ("eager", "compiled"):
        theirs = firsts.get((*shape, reference))
        if theirs is not None and reference != record["variant"]:
            error = (first["logits"] - theirs["logits"]).norm() / theirs["logits"].norm()
            record[f"logits_rel_err_vs_{reference}"] = error.item()
            record[f"first_token_equal_to_{reference}"] = (first["token"] == theirs["token"]).float().mean().item()

if __name__ == "__main__":
    main()
