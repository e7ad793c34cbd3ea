"""Where a decode step's time goes: the whole ``Runner.step`` against its whole-step graph's replay
alone, and the kernels of that graph (its forward run eagerly under the profiler, GPU time per kernel).

    PYTHONPATH=. python3 benchmarks/decode_profile.py --model gemma3n-e2b --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fx_fastprefill  # noqa: E402
from fx_fastprefill import SeqChunk  # noqa: E402
from benchmarks.prefill import MODELS  # noqa: E402
from benchmarks.timing import time_ms  # noqa: E402
from examples.gemma3n import Gemma3nLike  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="gemma3n-e2b", choices=sorted(MODELS))
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=8192 + 256)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    cfg = MODELS[args.model]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Gemma3nLike(cfg).to(torch.bfloat16)
    batches = [int(b) for b in args.batches.split(",")]
    sizes = sorted({max(2, b) for b in batches})
    runner = fx_fastprefill.Runner(model, backend=fx_fastprefill.backend(cudagraphs=True), max_num_tokens=1024,
                                   max_model_len=args.max_model_len, max_num_seqs=max(batches), device="cuda",
                                   dtype=torch.bfloat16, token_pad_sizes=[*sizes, 1024], whole_step_sizes=sizes)
    records = []
    for batch in batches:
        ids = list(range(batch))
        for rid in ids:
            runner.step([SeqChunk(rid, [(rid + j) % 1000 + 1 for j in range(args.context)], 0)])
        step = [SeqChunk(rid, [7]) for rid in ids]
        for _ in range(3):
            runner.step(step)
        graphs = runner.whole_step_graphs
        size = graphs.size_for(batch)
        graph, _ = graphs.graphs[size]
        step_ms = [time_ms(lambda: runner.step(step)) for _ in range(args.runs)]
        replay_ms = [time_ms(graph.replay) for _ in range(args.runs)]
        torch.cuda.synchronize()
        host = []
        for _ in range(args.runs):  # host time of a step until the replay is queued (the GPU runs behind)
            t0 = time.perf_counter()
            runner.step(step)
            host.append(1e3 * (time.perf_counter() - t0))
            torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs._call(size)  # the graph's forward, launched eagerly
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name[:90], []).append(e.device_time_total / 1e3)
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:30]
        record = {"model": args.model, "batch": batch, "padded": size, "context": args.context,
                  "step_ms": statistics.median(step_ms), "replay_ms": statistics.median(replay_ms),
                  "host_ms": statistics.median(host), "kernels": len(kernels),
                  "kernel_ms": sum(sum(v) for v in by_name.values()),
                  "top": [{"kernel": k, "count": len(v), "ms": sum(v)} for k, v in top]}
        records.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "top"}))
        for t in record["top"][:25]:
            print(f"  {t['ms']:.3f} ms  x{t['count']:<4d} {t['kernel']}")
        for rid in ids:
            runner.free(rid)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
