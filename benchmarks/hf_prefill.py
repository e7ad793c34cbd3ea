"""Prefill of unmodified transformers Gemma 3n / Gemma 4 on the GPU: torch.compile's default against
the fx_fastprefill backend, in the same run, random bf16 weights, ``logits_to_keep=1``, ``use_cache=False``.

Variants: ``inductor`` (``torch.compile`` default, no pass, ``dynamic=False``: a static compile per
shape, its best case), ``ffp`` (the backend, Inductor regions,
``dynamic=True``) and, for Gemma 4 where transformers has it, ``inductor_hand_slicing``
(transformers' own slicing of the KV-shared layers' inputs, under ``torch.compile`` default, static). The
Gemma 4 ``inductor`` and ``ffp`` variants run with that slicing switched off.

    PYTHONPATH=. python3 benchmarks/hf_prefill.py --model gemma3n --out results.json
    python3 benchmarks/hf_prefill.py --model gemma4 --smoke --out /tmp/smoke.json   # CPU: the script runs
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
from benchmarks.timing import repeat_ms  # noqa: E402
from examples import hf_gemma3n, hf_gemma4  # noqa: E402


def gemma3n_e2b():
    """Gemma-3n-E2B text shape: 30 layers, the last 10 sharing K/V, sliding window 512 on 4 of every 5."""
    layers = 30
    return hf_gemma3n.config(
        vocab_size=262_144, vocab_size_per_layer_input=262_144, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        hidden_size_per_layer_input=256, num_kv_shared_layers=10, sliding_window=512,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * (layers // 5),
        altup_num_inputs=4, laurel_rank=64, activation_sparsity_pattern=[0.95] * 10 + [0.0] * 20)


def gemma4_default_shared12():
    """transformers' default Gemma4TextConfig (30 layers) with num_kv_shared_layers=12."""
    from transformers import Gemma4TextConfig
    return Gemma4TextConfig(num_kv_shared_layers=12)


def build(name: str, device: str, smoke: bool):
    """The model in float32, its weights drawn on the GPU (drawing 2-5 B parameters on the CPU takes minutes)."""
    torch.manual_seed(0)
    with torch.device(device):
        if smoke:
            return (hf_gemma3n.tiny() if name == "gemma3n" else hf_gemma4.tiny(hand_slicing=True)).eval()
        if name == "gemma3n":
            from transformers import Gemma3nForCausalLM
            return Gemma3nForCausalLM(gemma3n_e2b()).eval()
        from transformers import Gemma4ForCausalLM
        return Gemma4ForCausalLM(gemma4_default_shared12()).eval()


def set_hand_slicing(model, on: bool) -> None:
    """Gemma 4: transformers' own slicing of the KV-shared layers' inputs on or off (an instance patch)."""
    if on:
        model.model.__dict__.pop("_maybe_slice_kv_shared_inputs", None)
    else:
        hf_gemma4.without_hand_slicing(model)


def rel_err(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x.float() - reference).norm() / reference.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["gemma3n", "gemma4"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--shapes", default="1x8192,8x2048")
    parser.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, tiny shapes, 2 runs: the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.runs = "1x24,3x16", 2
    device = "cpu" if args.smoke else "cuda"
    cuda = device == "cuda"
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    variants = ["inductor", "ffp"]
    if args.model == "gemma4":
        variants.insert(0, "inductor_hand_slicing")
    if args.variants:  # in the order given
        unknown = set(args.variants.split(",")) - set(variants)
        if unknown:
            parser.error(f"--variants: unknown {sorted(unknown)}; known for {args.model}: {variants}")
        variants = args.variants.split(",")
    import transformers
    model = build(args.model, device, args.smoke)
    cfg = model.config
    shared = sum(mode == "reuse" for mode in cfg.kv_sharing_modes)
    generator = torch.Generator(device=device).manual_seed(1)
    inputs = {shape: torch.randint(3, cfg.vocab_size, shape, device=device, generator=generator) for shape in shapes}
    with torch.no_grad():  # float32 eager logits: the reference every bf16 variant is compared with
        set_hand_slicing(model, False)
        fp32 = {
            shape: model(input_ids=ids, logits_to_keep=1, use_cache=False).logits.float()
            for shape, ids in inputs.items()
        }
    model.to(torch.bfloat16)
    records = []
    # Shape by shape, each variant compiled afresh (static shapes for torch.compile's default, its best
    # case): a run cut short still has every variant of the shapes it finished.
    for (batch, seq_len), ids in inputs.items():
        for variant in variants:
            torch._dynamo.reset()
            set_hand_slicing(model, variant == "inductor_hand_slicing")
            backend = fx_fastprefill.backend() if variant == "ffp" else None
            forward = (torch.compile(model.forward, backend=backend, dynamic=True) if backend is not None
                       else torch.compile(model.forward, dynamic=False))
            record = {"model": f"{args.model}-hf", "batch": batch, "seq_len": seq_len, "variant": variant,
                      "layers": cfg.num_hidden_layers, "shared_layers": shared,
                      "ideal_speedup": cfg.num_hidden_layers / (cfg.num_hidden_layers - shared),
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "device": torch.cuda.get_device_name() if cuda else "cpu"}
            try:
                with torch.no_grad():
                    def call():
                        return forward(input_ids=ids, logits_to_keep=1, use_cache=False).logits
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    logits = call()
                    if cuda:
                        torch.cuda.synchronize()
                    record["first_call_s"] = time.perf_counter() - start
                    times = repeat_ms(call, args.runs, cuda=cuda)
                    record["median_ms"] = statistics.median(times)
                    record["times_ms"] = times
                    eager = model(input_ids=ids, logits_to_keep=1, use_cache=False).logits
                    # Random bf16 weights: compare with float32 beside eager bf16's own error.
                    record["rel_err_vs_fp32"] = rel_err(logits, fp32[(batch, seq_len)])
                    record["eager_bf16_rel_err_vs_fp32"] = rel_err(eager, fp32[(batch, seq_len)])
                    if cuda:
                        record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                if backend is not None:
                    report = backend.reports[-1]
                    record.update(cut=report.cut, reason=report.reason, eligible_layers=report.eligible_layers,
                                  reduced_layers=report.reduced_layers, flops_removed=report.flops_removed_fraction,
                                  fallbacks=dict(backend.fallbacks))
            except Exception:  # noqa: BLE001 - recorded; the other variants still run
                record["error"] = traceback.format_exc(limit=6)
            print(json.dumps({k: v for k, v in record.items() if k != "times_ms"}), flush=True)
            records.append(record)
            with open(args.out, "w") as f:  # after every record: a run cut short keeps what it measured
                json.dump(records, f, indent=1)
            forward = None  # free the compiled model before the next variant
            if cuda:
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
