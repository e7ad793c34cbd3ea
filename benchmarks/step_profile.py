"""Where one step's time goes: host time to issue it, device busy time, and the gap between them.

A step is host-bound when the host takes longer to issue its work than the device takes to run it;
then only fewer or cheaper host calls make it faster. For each variant and shape this prints and
writes: ``host_ms`` (``Runner.step`` returns before the device finishes), ``total_ms`` (CUDA events,
to the end of the device work), ``device_busy_ms`` / ``device_span_ms`` (union of the kernels in a
profiler trace, and first to last kernel) and the operators that cost the host most.

    PYTHONPATH=. python3 benchmarks/step_profile.py --model gemma3n-e2b --variants inductor,ffp_cudagraph \
        --out $OUT/profile.json --traces $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.prefill import MODELS, make_runner, prefill_once, prepare_decode, prompts  # noqa: E402
from examples.gemma3n import Gemma3nLike  # noqa: E402


def host_and_total_ms(fn, runs: int) -> tuple[float, float]:
    hosts, totals = [], []
    for _ in range(runs):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        hosts.append(1e3 * (time.perf_counter() - t0))
        end.record()
        torch.cuda.synchronize()
        totals.append(start.elapsed_time(end))
    return statistics.median(hosts), statistics.median(totals)


def device_busy_ms(trace_events: list[dict]) -> tuple[float, float]:
    """Union of the device's kernel, copy and memset intervals, and the span from the first to the
    last of them (busy < span: the device waited for the host)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace_events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not spans:
        return 0.0, 0.0
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / 1e3, (end - spans[0][0]) / 1e3


def profiled(fn, trace: Path) -> tuple[float, float, str]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    busy_ms, span_ms = device_busy_ms(json.loads(trace.read_text())["traceEvents"])
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    return busy_ms, span_ms, table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma3n-e2b", choices=sorted(MODELS))
    parser.add_argument("--variants", default="inductor,ffp_cudagraph")
    parser.add_argument("--shapes", default="1x2048,1x8192")
    parser.add_argument("--decode-batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", required=True)
    parser.add_argument("--traces", default=None, help="folder for Chrome traces (one per variant and shape)")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = MODELS[args.model]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    with torch.device(device):
        weights = Gemma3nLike(cfg).to(dtype).state_dict()
    step_sizes = sorted({b * s for b, s in shapes} | {max(2, args.decode_batch)})
    logits_sizes = sorted({max(2, b) for b, _ in shapes} | {max(2, args.decode_batch)})
    records, traces = [], Path(args.traces or tempfile.mkdtemp())
    for variant in args.variants.split(","):
        runner = make_runner(variant, cfg, weights, device, dtype, max(step_sizes), step_sizes, logits_sizes)
        if variant.startswith("ffp_cudagraph"):  # as prefill.py: every CUDA-graph variant records up front
            runner.capture(progress=False)
        cases = [(f"prefill {b}x{s}", lambda t=prompts(b, s, cfg.vocab_size): prefill_once(runner, t), b, s + 1)
                 for b, s in shapes]
        for name, fn, batch, length in cases + [("decode", None, args.decode_batch, 160)]:
            runner.resize_kv_cache(batch, length)
            if fn is None:
                step = prepare_decode(runner, batch, cfg.vocab_size, 128)
                fn = lambda step=step: runner.step(step)  # noqa: E731
            for _ in range(3):
                fn()
            host_ms, total_ms = host_and_total_ms(fn, args.runs)
            trace = traces / f"{args.model}-{variant}-{name.replace(' ', '-')}.json"
            busy_ms, span_ms, table = profiled(fn, trace)
            record = {"model": args.model, "variant": variant, "case": name, "host_ms": host_ms,
                      "total_ms": total_ms, "device_busy_ms": busy_ms, "device_span_ms": span_ms,
                      "fallbacks": dict(runner.fallbacks or {})}
            print(json.dumps(record), flush=True)
            print(table, flush=True)
            records.append({**record, "top_host_ops": table})
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
        runner = None  # free the model and its graphs before the next variant
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
