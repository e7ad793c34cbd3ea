"""How far a step runs from the card's limits: FLOPs and bytes it must execute and move, its time,
and the fractions of the card's dense bf16 peak (``mfu``) and of the time the bytes alone would
take at the card's bandwidth (``of_bandwidth_bound``), for the flat example models at Gemma E2B
shapes, prefill and whole-step decode, per step and per region, with the top kernels by time.

FLOPs are counted from the model's config (``step_counts``): every matrix product and attention,
as the step executes them (the cut program's reduced layers on the logits rows only, causal
and sliding-window keys counted per query); elementwise work is not counted. The count is checked
against the compiled program's own graph count (the report's ``flops_full`` / ``flops_cut``) in
tests/test_benchmark_tables.py. Bytes are what no program can avoid moving: every weight read once
(the embedding tables only at the rows gathered), K/V written once and read once per attention
layer (a layer's keys: all of its sequence's, or its window's), the logits written; activations
between layers are not counted, so ``of_bandwidth_bound`` is an upper bound on how close a
prefill step is to the bytes limit (decode at batch 1 is weights and K/V).

Records ``{model, shape, variant, device_name, step_ms, tflop, mfu, gbytes, of_bandwidth_bound,
regions, top_kernels, ...}``; the peak and bandwidth are the card's datasheet numbers (dense
bf16, HBM), and the ceilings this card reached in this run (an 8192^3 bf16 matrix product, a 2 GiB
copy) are kept beside them.

    PYTHONPATH=. python3 benchmarks/roofline.py --out $OUT/roofline.json
    python3 benchmarks/roofline.py --smoke --out /tmp/roofline.json     # CPU, tiny model: the script runs
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.prefill import MODELS, make_runner, prefill_once, prepare_decode, prompts  # noqa: E402
from benchmarks.timing import repeat_ms  # noqa: E402
from examples.gemma3n import Config, Gemma3nLike, layer_is_sliding  # noqa: E402

# name fragment -> (dense bf16 TFLOP/s, HBM GB/s), the datasheets' numbers; the first match wins.
CARDS = (("H100 PCIe", 756.0, 2000.0), ("H100 NVL", 835.0, 3900.0), ("H100", 989.0, 3350.0),
         ("H200", 989.0, 4800.0), ("A100", 312.0, 2039.0))
VARIANTS = ("inductor", "ffp_cudagraph")
PREFILL_SHAPES = ("1x8192", "1x32768", "8x4096")
DECODE_BATCHES = (1, 16)
DECODE_CONTEXT = 1024


def card_limits(name: str) -> tuple[float, float] | tuple[None, None]:
    for fragment, tflops, gbps in CARDS:
        if fragment in name:
            return tflops, gbps
    return None, None


@dataclass
class Work:
    """FLOPs and bytes of one step or region."""

    flop: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flop + other.flop, self.bytes + other.bytes)


def _causal_keys(seq_len: int, window: int | None, context: int = 0) -> int:
    """Keys seen by the ``seq_len`` new queries of a sequence after ``context`` cached tokens,
    summed over the queries (each sees the keys up to itself, at most ``window`` of them)."""
    return sum(min(context + p + 1, window or context + p + 1) for p in range(seq_len))


def layer_work(cfg: Config, i: int, rows: int, kv_rows: int, keys: int, kv_rows_read: int, elt: int) -> Work:
    """One layer whose block runs on ``rows`` rows (queries seeing ``keys`` keys in all, summed over
    them) and whose own K/V (if it has them) are computed for ``kv_rows`` rows."""
    q, kv, d, s = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.dim, cfg.num_streams
    shares = i >= cfg.n_layers - cfg.num_kv_shared_layers
    weights = 2 * d * q + 3 * d * cfg.mlp_hidden + 2 * d * cfg.per_layer_dim + s * s + s + 2 * d + cfg.head_dim
    flop = rows * 2 * (2 * d * q + 3 * d * cfg.mlp_hidden + 2 * d * cfg.per_layer_dim)
    flop += max(rows, kv_rows) * 2 * s * s * d  # the AltUp prediction feeds the K/V rows too
    flop += 4 * cfg.n_heads * cfg.head_dim * keys
    kv_bytes = 2 * kv * elt * kv_rows_read
    if not shares:
        weights += 2 * d * kv + cfg.head_dim
        flop += kv_rows * 2 * 2 * d * kv
        kv_bytes += 2 * kv * elt * kv_rows
    return Work(flop, weights * elt + kv_bytes)


def step_work(cfg: Config, seqs: list[tuple[int, int]], cut: bool, elt: int) -> dict[str, Work]:
    """FLOPs and bytes of one step over ``seqs`` = [(new tokens, cached tokens)], one logits row
    each (the last), by region: ``full`` (what runs on every row) and ``reduced`` (what runs on the
    logits rows), as the cut program runs it (``cut``) or as one graph (the head alone reduced).

    The cut program runs the KV-sharing layers on the logits rows, and of the last layer before them
    only what their K/V need (its K/V projection) on every row: the rest of that layer feeds the
    sharing layers' queries alone (passes/gather_hoisting.py hoists the gather up to there)."""
    t, r = sum(n for n, _ in seqs), len(seqs)
    d, p, v, layers = cfg.dim, cfg.per_layer_dim, cfg.vocab_size, cfg.n_layers
    last_full = layers - cfg.num_kv_shared_layers - 1 if cut else layers  # the layer cut in two
    window = [cfg.sliding_window if layer_is_sliding(cfg, i) else None for i in range(layers)]
    # Embedding rows, AltUp streams, per-layer inputs (the cut computes the slices of the layers
    # that run on the logits rows for those rows only).
    full_slices = min(last_full, layers)
    full = Work(t * 2 * d * ((cfg.num_streams - 1) * d + full_slices * p) + r * 2 * d * (layers - full_slices) * p,
                elt * (t * (d + layers * p) + d * ((cfg.num_streams - 1) * d + layers * p)))
    reduced = Work(r * 2 * d * v, elt * (v * d + d) + 4 * r * v)  # head and norm; fp32 logits written
    for i in range(layers):
        seen = sum(min(n + c, window[i] or n + c) for n, c in seqs)  # keys of each sequence's last row
        if i < last_full:
            keys = sum(_causal_keys(n, window[i], c) for n, c in seqs)
            full += layer_work(cfg, i, t, t, keys, seen, elt)
        elif i == last_full:  # K/V on every row (the full region), the rest on the logits rows
            full += layer_work(cfg, i, 0, t, 0, 0, elt)  # the layer's weights counted here, once
            rest = layer_work(cfg, i, r, 0, seen, seen, elt)
            weights = layer_work(cfg, i, 0, 0, 0, 0, elt).bytes
            reduced += Work(rest.flop - r * 2 * cfg.num_streams ** 2 * d, rest.bytes - weights)
        else:
            reduced += layer_work(cfg, i, r, r, seen, seen, elt)
    return {"full": full, "reduced": reduced}


def measured_ceilings() -> dict:
    """This card's bf16 matrix-product rate and copy bandwidth, measured once."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = statistics.median(repeat_ms(lambda: a @ b, 20, warmup=5))
    src = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB read + 1 GiB written
    dst = torch.empty_like(src)
    copy_ms = statistics.median(repeat_ms(lambda: dst.copy_(src), 20, warmup=5))
    return {"matmul_tflops": 2 * 8192**3 / mm_ms / 1e9, "copy_gbps": 2 * 2**30 / copy_ms / 1e6}


def top_kernels(fn, count: int = 15) -> list[dict]:
    """The kernels of one call by device time (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(event.name[:100], []).append(event.device_time_total / 1e3)
    total = sum(sum(v) for v in by_name.values()) or 1.0
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:count]
    return [{"kernel": k, "count": len(v), "ms": sum(v), "share": sum(v) / total} for k, v in ranked]


def record(base: dict, step_ms: float, times: list[float], regions: dict[str, Work], peak, bandwidth) -> dict:
    work = regions["full"] + regions["reduced"]
    seconds = step_ms / 1e3
    out = {**base, "step_ms": step_ms, "times_ms": times, "tflop": work.flop / 1e12, "gbytes": work.bytes / 1e9,
           "achieved_tflops": work.flop / seconds / 1e12, "achieved_gbps": work.bytes / seconds / 1e9,
           "regions": {name: {"tflop": w.flop / 1e12, "gbytes": w.bytes / 1e9} for name, w in regions.items()}}
    if peak:
        out["mfu"] = out["achieved_tflops"] / peak
        out["of_bandwidth_bound"] = (work.bytes / (bandwidth * 1e9)) / seconds
        out["compute_bound_ms"] = work.flop / (peak * 1e12) * 1e3
        out["bandwidth_bound_ms"] = work.bytes / (bandwidth * 1e9) * 1e3
    return out


def run_variant(model_name: str, variant: str, args, device, dtype, weights, peak, bandwidth, base) -> list[dict]:
    cfg = MODELS[model_name]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    step_sizes = sorted({max(2, b * s) for b, s in shapes} | {max(2, b) for b in batches})
    logits_sizes = sorted({max(2, b) for b, _ in shapes} | {max(2, b) for b in batches})
    max_seqs = max([1, *batches, *(b for b, _ in shapes)])
    runner = make_runner(variant, cfg, weights, device, dtype, max(step_sizes), step_sizes, logits_sizes,
                         max_num_seqs=max_seqs)
    if variant.startswith("ffp_cudagraph"):
        runner.capture(progress=False)
    elt = torch.tensor([], dtype=dtype).element_size()
    out = []
    for batch, seq_len in shapes:
        runner.resize_kv_cache(batch, seq_len + 1)
        tokens = prompts(batch, seq_len, cfg.vocab_size)
        fn = lambda: prefill_once(runner, tokens)  # noqa: E731
        times = repeat_ms(fn, args.runs, warmup=2, cuda=device.type == "cuda")
        cut = variant.startswith("ffp") and runner.report is not None and runner.report.cut
        regions = step_work(cfg, [(seq_len, 0)] * batch, cut, elt)
        rec = record({**base, "model": model_name, "variant": variant, "shape": f"{batch}x{seq_len}",
                      "phase": "prefill", "cut": bool(cut)}, statistics.median(times), times, regions, peak, bandwidth)
        if device.type == "cuda":
            rec["top_kernels"] = top_kernels(fn)
        out.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in ("times_ms", "top_kernels")}), flush=True)
    for batch in batches:
        runner.resize_kv_cache(batch, args.context + args.runs + 8)
        step = prepare_decode(runner, batch, cfg.vocab_size, args.context)
        fn = lambda: runner.step(step)  # noqa: E731
        counts_before = dict(runner.step_counts)
        times = repeat_ms(fn, args.runs, warmup=2, cuda=device.type == "cuda")
        modes = {k: v - counts_before.get(k, 0) for k, v in runner.step_counts.items() if v != counts_before.get(k, 0)}
        # Decode has one logits row per request: every layer runs on it, cut or not.
        regions = step_work(cfg, [(1, args.context)] * batch, False, elt)
        rec = record({**base, "model": model_name, "variant": variant, "shape": f"decode b{batch}",
                      "phase": "decode", "context": args.context, "graph_modes": modes}, statistics.median(times),
                     times, regions, peak, bandwidth)
        if device.type == "cuda":
            rec["top_kernels"] = top_kernels(fn)
        out.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in ("times_ms", "top_kernels")}), flush=True)
        for chunk in step:
            runner.free(chunk.seq_id)
    return out


def parse_inductor_settings(text: str) -> dict[str, object]:
    """``"a=1,b.c=True"`` -> ``{"a": 1, "b.c": True}``; a key Inductor does not have is an error."""
    import torch._inductor.config as inductor_config
    settings: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or key not in inductor_config._config:
            raise SystemExit(f"--inductor-config: {item!r} is not key=value with a key Inductor has")
        try:
            settings[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):  # a bare word: a string setting
            settings[key] = raw
    return settings


def run_models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, peak: float | None,
               bandwidth: float | None, base: dict) -> list[dict]:
    """Every model and variant asked for; the records so far written to ``args.out`` after each."""
    records: list[dict] = []
    for model_name in args.models.split(","):
        torch.manual_seed(0)
        with torch.device(device):
            weights = Gemma3nLike(MODELS[model_name]).to(dtype).state_dict()
        for variant in args.variants.split(","):
            try:
                records += run_variant(model_name, variant, args, device, dtype, weights, peak, bandwidth, base)
            except Exception:  # noqa: BLE001 - recorded; the other variants still run
                records.append({**base, "model": model_name, "variant": variant, "error": traceback.format_exc()})
                print(records[-1]["error"], flush=True)
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="gemma3n-e2b,gemma4-e2b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shapes", default=",".join(PREFILL_SHAPES))
    parser.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)))
    parser.add_argument("--context", type=int, default=DECODE_CONTEXT)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny shapes, 2 runs")
    parser.add_argument("--inductor-config", default="",
                        help="Inductor settings for every variant, to measure a lever: key=value,... (Python "
                             "literals, else strings); recorded in each record")
    args = parser.parse_args()
    inductor_settings = parse_inductor_settings(args.inductor_config)
    if args.smoke:
        args.models, args.shapes, args.decode_batches, args.context, args.runs = "tiny", "1x16,2x8", "1,2", 8, 2
        args.variants = "inductor,ffp"
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak, bandwidth = card_limits(name)
    base = {"device_name": name, "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
            "peak_tflops": peak, "bandwidth_gbps": bandwidth, "inductor_config": inductor_settings}
    if device.type == "cuda":
        base["measured"] = measured_ceilings()
        print(json.dumps(base), flush=True)
    import torch._inductor.config as inductor_config
    with inductor_config.patch(inductor_settings):
        records = run_models(args, device, dtype, peak, bandwidth, base)
    print(f"{'model':12s} {'shape':12s} {'variant':15s} {'ms':>9s} {'TFLOP':>8s} {'mfu':>6s} {'GB':>7s} {'of_bw':>6s}")
    for r in records:
        if "error" not in r:
            print(f"{r['model']:12s} {r['shape']:12s} {r['variant']:15s} {r['step_ms']:9.3f} {r['tflop']:8.3f} "
                  f"{r.get('mfu', 0):6.3f} {r['gbytes']:7.3f} {r.get('of_bandwidth_bound', 0):6.3f}")


if __name__ == "__main__":
    main()
