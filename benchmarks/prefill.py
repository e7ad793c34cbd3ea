"""Prefill (and decode) of the flat-convention example at Gemma E2B shapes: every variant side by side.

Variants: ``eager`` (no compile), ``inductor`` (``torch.compile`` default, no pass), ``ffp`` (the
backend, Inductor regions), ``ffp_cudagraph`` (the backend with piecewise CUDA graphs, every step
size captured before the first prefill), ``hand_split`` (the model split by hand at the KV-sharing
boundary, ``torch.compile`` default: what a manual port gets). Each prefill is one Runner step of
fresh prompts, one logits row each; medians of ``--runs`` timed runs after warm-up, CUDA events;
the first call of a variant is its compile time.

An A/B variant, on request: ``ffp_cudagraph_unnarrowed`` (``narrow_slices=False``: what
passes/narrow_sliced_producers.py is worth).

    PYTHONPATH=. python3 benchmarks/prefill.py --out benchmarks/results/2026-12-04-h200.json
    python3 benchmarks/prefill.py --smoke --out /tmp/smoke.json     # CPU, tiny model: the script runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fx_fastprefill  # noqa: E402
from fx_fastprefill import SeqChunk  # noqa: E402
from benchmarks.timing import repeat_ms  # noqa: E402
from examples.gemma3n import PRESETS, Config, Gemma3nLike  # noqa: E402

MODELS = {
    "gemma3n-e2b": PRESETS["e2b"],  # 30 layers, the last 10 share K/V
    "gemma4-e2b": Config(**{**PRESETS["e2b"].__dict__, "n_layers": 35, "num_kv_shared_layers": 20}),
    "tiny": Config(),
}
VARIANTS = ("eager", "inductor", "ffp", "ffp_cudagraph", "hand_split")  # and the A/B variant above, on request
SHAPES = ((1, 2048), (1, 8192), (1, 32768), (8, 4096), (64, 512))


def make_runner(variant: str, cfg: Config, weights: dict, device, dtype, max_tokens: int,
                step_sizes: list[int], logits_sizes: list[int], max_num_seqs: int = 1) -> fx_fastprefill.Runner:
    with torch.device("meta"):  # no second random init: every variant shares the same weights
        model = Gemma3nLike(cfg, hand_split=variant == "hand_split")
    model.load_state_dict(weights, assign=True)
    backend = {"eager": None, "inductor": "inductor", "hand_split": "inductor", "ffp": fx_fastprefill.backend(),
               "ffp_cudagraph": fx_fastprefill.backend(cudagraphs=True),
               "ffp_cudagraph_unnarrowed": fx_fastprefill.backend(cudagraphs=True, narrow_slices=False),
               "ffp_cudagraph_library_small_k": fx_fastprefill.backend(cudagraphs=True, small_contractions=False),
               }[variant]
    # The CUDA-graph variant captures exactly the step sizes the benchmark runs; every variant pads
    # its logits rows to the row counts the benchmark uses (one per sequence), the same for all.
    pad = {"token_pad_sizes": step_sizes} if variant.startswith("ffp_cudagraph") else {}
    return fx_fastprefill.Runner(model, backend=backend, max_num_tokens=max_tokens, max_model_len=16, device=device,
                                 dtype=dtype, max_num_seqs=max_num_seqs, logits_pad_sizes=logits_sizes, **pad)


def prompts(batch: int, seq_len: int, vocab: int) -> list[list[int]]:
    """Fixed prompts of a shape, built outside the timed region (a 64x512 batch takes ~2 ms of Python)."""
    return [[(7 * i + j) % (vocab - 1) + 1 for j in range(seq_len)] for i in range(batch)]


def prefill_once(runner: fx_fastprefill.Runner, tokens: list[list[int]]) -> None:
    chunks = [SeqChunk(1000 + i, t) for i, t in enumerate(tokens)]
    runner.step(chunks)
    for c in chunks:
        runner.free(c.seq_id)


def prepare_decode(runner: fx_fastprefill.Runner, batch: int, vocab: int, context: int) -> list[SeqChunk]:
    """Prefill ``batch`` requests of ``context`` tokens (no logits); returns their next decode step."""
    for i in range(batch):
        tokens = [(3 * i + j) % (vocab - 1) + 1 for j in range(context)]
        for start in range(0, context, runner.max_num_tokens):
            runner.step([SeqChunk(2000 + i, tokens[start: start + runner.max_num_tokens], 0)])
    return [SeqChunk(2000 + i, [5]) for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="gemma3n-e2b,gemma4-e2b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in SHAPES))
    parser.add_argument("--decode-batches", default="1,8,64")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny shapes, 2 runs")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.shapes, args.decode_batches, args.runs = "tiny", "1x16,2x8", "1,2", 2
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    decode_batches = [int(b) for b in args.decode_batches.split(",") if b]
    cuda, records = device.type == "cuda", []

    def save():
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)

    for model_name in args.models.split(","):
        cfg = MODELS[model_name]
        torch.manual_seed(0)
        with torch.device(device):  # random init on the device: seconds, not minutes, at 4B parameters
            weights = Gemma3nLike(cfg).to(dtype).state_dict()
        ideal = cfg.n_layers / (cfg.n_layers - cfg.num_kv_shared_layers)
        max_tokens = max(b * s for b, s in shapes)
        for variant in args.variants.split(","):
            variant_start = time.perf_counter()
            base = {"model": model_name, "variant": variant, "ideal_speedup": ideal, "device": str(device),
                    "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "dtype": str(dtype).replace("torch.", "")}
            step_sizes = sorted({max(2, b * s) for b, s in shapes} | {max(2, b) for b in decode_batches})
            logits_sizes = sorted({max(2, b) for b, _ in shapes} | {max(2, b) for b in decode_batches})
            try:
                runner = make_runner(variant, cfg, weights, device, dtype, max_tokens, step_sizes, logits_sizes)
                capture_s = runner.capture(progress=False) if variant.startswith("ffp_cudagraph") else None
            except Exception:  # noqa: BLE001 - recorded; the other variants still run
                records.append({**base, "error": traceback.format_exc(limit=8)})
                print(json.dumps(records[-1]), flush=True)
                continue
            if capture_s is not None:  # compile and capture of every size, before the first prefill
                base["compile_and_capture_s"] = capture_s
            first = True
            for batch, seq_len in shapes:
                record = {**base, "batch": batch, "seq_len": seq_len, "phase": "prefill"}
                try:
                    runner.resize_kv_cache(batch, seq_len + 1)
                    tokens = prompts(batch, seq_len, cfg.vocab_size)
                    start = time.perf_counter()
                    prefill_once(runner, tokens)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    record["first_call_s"] = time.perf_counter() - start
                    record["includes_compile"] = (
                        first and variant != "eager" and not variant.startswith("ffp_cudagraph")
                    )
                    first = False
                    times = repeat_ms(lambda: prefill_once(runner, tokens), args.runs, warmup=1, cuda=cuda)
                    record.update(median_ms=statistics.median(times), times_ms=times)
                    if device.type == "cuda":
                        record["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
                    if variant.startswith("ffp") and runner.report is not None:
                        record.update(cut=runner.report.cut, reduced_layers=len(runner.report.reduced_layers),
                                      cudagraphs=runner.report.cudagraphs, fallbacks=dict(runner.fallbacks or {}))
                except Exception:  # noqa: BLE001
                    record["error"] = traceback.format_exc(limit=4)
                print(json.dumps({k: v for k, v in record.items() if k != "times_ms"}), flush=True)
                records.append(record)
                save()
            for batch in decode_batches if variant in ("inductor", "ffp", "ffp_cudagraph") else ():
                record = {**base, "batch": batch, "seq_len": 1, "context": 128, "phase": "decode"}
                try:
                    runner.resize_kv_cache(batch, 128 + args.runs + 2)
                    step = prepare_decode(runner, batch, cfg.vocab_size, 128)
                    # Consecutive decode steps (warm-up: the decode-size compile, if any).
                    times = repeat_ms(lambda: runner.step(step), args.runs, warmup=1, cuda=cuda)
                    record.update(median_ms=statistics.median(times), times_ms=times)
                    for c in step:
                        runner.free(c.seq_id)
                except Exception:  # noqa: BLE001
                    record["error"] = traceback.format_exc(limit=4)
                print(json.dumps({k: v for k, v in record.items() if k != "times_ms"}), flush=True)
                records.append(record)
                save()
            runner = None  # free the model and its graphs before the next variant
            print(f"# {model_name} {variant}: {time.perf_counter() - variant_start:.0f} s", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
