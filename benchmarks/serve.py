"""Serving under load on the Runner: continuous batching, chunked prefill, TTFT / TPOT / throughput,
with the pass (``ffp``) and without it (``no_pass``: ``fast_prefill=False``, the same CUDA graphs)
in one run, on the same weights and the same requests.

The serving loop is a user's own, on ``Runner.step`` / ``Runner.free``: each step takes the decode
row of every running request first, then continues prompts already started, then admits waiting
requests while KV regions are free, all under the token budget (``--max-num-tokens``); a prompt
longer than what is left is chunked. Requests arrive by a Poisson process (``--rate``, requests/s)
or at a fixed concurrency (a new one as soon as one finishes). TTFT runs from a request's arrival
to its first token on the host; TPOT is (last token - first token) / (tokens - 1). Greedy tokens.

Workloads: ``vllm-8k`` (64 requests x 8192-token prompts x 20 output tokens, concurrency 1: the
setup of vLLM's Gemma 3n fast-prefill change) and ``mixed-c8`` (concurrency 8, prompts 512-8192,
outputs 64-256, uniform, seeded). Before serving, ``--decode-batches`` times one decode step of
that many requests (context ``--decode-context``) through the whole-step graphs and, for the
record, piecewise (the graphs turned off on the same Runner).

    PYTHONPATH=. python3 benchmarks/serve.py --model gemma3n-e2b --out OUT.json
    python3 benchmarks/serve.py --smoke --out /tmp/serve.json       # CPU, tiny model, fp32: the script runs
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fx_fastprefill  # noqa: E402
from fx_fastprefill import SeqChunk  # noqa: E402
from benchmarks.prefill import MODELS  # noqa: E402
from benchmarks.timing import time_ms  # noqa: E402
from examples.gemma3n import Gemma3nLike  # noqa: E402


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: tuple[int, int]   # uniform in [lo, hi]
    output_len: tuple[int, int]
    concurrency: int | None = None
    rate: float | None = None     # requests per second (Poisson), when concurrency is None


WORKLOADS = {
    "vllm-8k": Workload(64, (8192, 8192), (20, 20), concurrency=1),
    "mixed-c8": Workload(64, (512, 8192), (64, 256), concurrency=8),
}
SMOKE_WORKLOADS = {
    "vllm-8k": Workload(4, (40, 40), (5, 5), concurrency=1),
    "mixed-c8": Workload(8, (4, 60), (2, 9), concurrency=3),
}
VARIANTS = ("ffp", "no_pass")


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    computed: int = 0  # prompt tokens in the KV cache
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)


def make_requests(workload: Workload, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(1, vocab) for _ in range(rng.randint(*workload.prompt_len))],
                    rng.randint(*workload.output_len)) for i in range(workload.num_requests)]


def arrival_times(workload: Workload, seed: int) -> list[float] | None:
    """Poisson arrivals (seconds from the start), or None for a fixed concurrency."""
    if workload.rate is None:
        return None
    rng, t, times = random.Random(seed + 1), 0.0, []
    for _ in range(workload.num_requests):
        t += rng.expovariate(workload.rate)
        times.append(t)
    return times


def serve(runner: fx_fastprefill.Runner, requests: list[Request], workload: Workload, seed: int,
          progress: bool) -> dict:
    """Run every request to its last token; returns the step count and the wall time."""
    arrivals = arrival_times(workload, seed)
    pending, waiting, running, done = list(requests), [], [], []
    budget_total, slots = runner.max_num_tokens, runner.kv_cache.free_regions
    start = time.perf_counter()
    steps = 0
    while len(done) < len(requests):
        now = time.perf_counter() - start
        if arrivals is None:  # fixed concurrency: a request arrives as soon as there is room for it
            while pending and len(waiting) + len(running) < workload.concurrency:
                request = pending.pop(0)
                request.arrival = now
                waiting.append(request)
        else:
            while pending and arrivals[pending[0].rid] <= now:
                request = pending.pop(0)
                request.arrival = arrivals[request.rid]
                waiting.append(request)
        if not waiting and not running:
            time.sleep(max(0.0, arrivals[pending[0].rid] - now))
            continue
        budget, chunks, plan = budget_total, [], []
        for request in running:  # decode rows, then prompts already started
            if not request.in_prefill and budget:
                chunks.append(SeqChunk(request.rid, [request.output[-1]], 1))
                plan.append((request, 1))
                budget -= 1
        for request in running:
            if request.in_prefill and budget:
                budget -= _prompt_chunk(request, budget, chunks, plan)
        while waiting and budget and len(running) < slots:
            request = waiting.pop(0)
            running.append(request)
            budget -= _prompt_chunk(request, budget, chunks, plan)
        logits = runner.step(chunks)
        tokens = logits.argmax(-1).tolist()  # the step's one wait for the device
        now = time.perf_counter() - start
        steps += 1
        row = 0
        for request, n in plan:
            if request.in_prefill:
                request.computed += n
                if request.in_prefill:
                    continue  # a chunk short of the prompt's end: no logits row
            request.output.append(tokens[row])
            request.token_times.append(now)
            row += 1
        for request in [r for r in running if len(r.output) >= r.max_new_tokens]:
            running.remove(request)
            runner.free(request.rid)
            done.append(request)
            if progress:
                sys.stderr.write(f"\r  {len(done)}/{len(requests)} requests, {steps} steps   ")
                sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    return {"steps": steps, "duration_s": time.perf_counter() - start}


def _prompt_chunk(request: Request, budget: int, chunks: list[SeqChunk], plan: list) -> int:
    n = min(len(request.prompt) - request.computed, budget)
    last = request.computed + n == len(request.prompt)
    chunks.append(SeqChunk(request.rid, request.prompt[request.computed: request.computed + n], 1 if last else 0))
    plan.append((request, n))
    return n


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(requests: list[Request], served: dict) -> dict:
    ttft = [1e3 * (r.token_times[0] - r.arrival) for r in requests]
    tpot = [1e3 * (r.token_times[-1] - r.token_times[0]) / (len(r.output) - 1) for r in requests if len(r.output) > 1]
    output_tokens = sum(len(r.output) for r in requests)
    return {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50) if tpot else None,
            "tpot_p99_ms": percentile(tpot, 99) if tpot else None,
            "throughput_tok_s": output_tokens / served["duration_s"],
            "prompt_tok_s": sum(len(r.prompt) for r in requests) / served["duration_s"],
            "num_requests": len(requests), "output_tokens": output_tokens, **served}


def time_decode_steps(runner: fx_fastprefill.Runner, batch: int, context: int, runs: int, vocab: int,
                      cuda: bool) -> list[float]:
    """Milliseconds of one decode step of ``batch`` requests at ``context`` cached tokens (host time
    included: CUDA events around the whole ``step`` call, the device idle while the host prepares)."""
    ids = [5000 + i for i in range(batch)]
    for i, rid in enumerate(ids):  # prefill without logits rows: the reduced region is skipped
        tokens = [(3 * i + j) % (vocab - 1) + 1 for j in range(context)]
        for lo in range(0, context, runner.max_num_tokens):
            runner.step([SeqChunk(rid, tokens[lo: lo + runner.max_num_tokens], 0)])
    step = [SeqChunk(rid, [7]) for rid in ids]
    for _ in range(3):  # warm-up (and, without capture(), warm-up then recording)
        runner.step(step)
    times = [time_ms(lambda: runner.step(step), cuda) for _ in range(runs)]
    for rid in ids:
        runner.free(rid)
    return times


def make_runner(variant: str, cfg, weights: dict, device, dtype, args) -> fx_fastprefill.Runner:
    with torch.device("meta"):
        model = Gemma3nLike(cfg)
    model.load_state_dict(weights, assign=True)
    cuda = device.type == "cuda"
    backend = fx_fastprefill.backend(fast_prefill=variant == "ffp", cudagraphs=cuda,
                                     compiler="inductor" if cuda else "eager")
    return fx_fastprefill.Runner(model, backend=backend, max_num_tokens=args.max_num_tokens,
                                 max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                 device=device, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="gemma3n-e2b", choices=sorted(MODELS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rate", type=float, default=None,
                        help="Poisson arrivals (requests/s) instead of a fixed concurrency")
    parser.add_argument("--custom", metavar="N,PROMPT_LO-HI,OUTPUT_LO-HI,CONCURRENCY",
                        help="a workload 'custom' of your own, e.g. 32,1024-4096,16-64,4 (with --workloads custom)")
    parser.add_argument("--max-num-tokens", type=int, default=8192, help="the token budget of a step")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=8192 + 256)
    parser.add_argument("--decode-batches", default="1,8,64")
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--decode-runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, fp32, small workloads")
    args = parser.parse_args()
    workloads = dict(WORKLOADS)
    if args.custom:
        n, prompt, output, concurrency = args.custom.split(",")
        lo_hi = lambda text: tuple(int(x) for x in text.split("-"))  # noqa: E731
        workloads["custom"] = Workload(int(n), lo_hi(prompt), lo_hi(output), concurrency=int(concurrency))
    if args.smoke:
        args.model, workloads = "tiny", {**SMOKE_WORKLOADS, **{k: v for k, v in workloads.items() if k == "custom"}}
        args.max_num_tokens, args.max_num_seqs, args.max_model_len = 32, 4, 80
        args.decode_batches, args.decode_context, args.decode_runs = "1,3", 20, 3
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    cuda = device.type == "cuda"
    cfg = MODELS[args.model]
    torch.manual_seed(args.seed)
    with torch.device(device):
        weights = Gemma3nLike(cfg).to(dtype).state_dict()
    records: list[dict] = []

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)

    base = {"model": args.model, "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype)[6:],
            "torch": torch.__version__, "ideal_ttft_ratio": 1 - cfg.num_kv_shared_layers / cfg.n_layers,
            "max_num_tokens": args.max_num_tokens, "max_num_seqs": args.max_num_seqs}
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    unknown = [name for name in args.workloads.split(",") if name and name not in workloads]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(workloads)} (custom needs --custom)")
    workloads = {name: workloads[name] for name in args.workloads.split(",") if name}
    for variant in args.variants.split(","):
        try:
            t0 = time.perf_counter()
            runner = make_runner(variant, cfg, weights, device, dtype, args)
            capture_s = runner.capture(progress=True) if cuda else None
            setup = {**base, "variant": variant, "capture_s": capture_s,
                     "setup_s": time.perf_counter() - t0, "whole_step_sizes": runner.whole_step_sizes}
            print(f"{variant}: set up in {setup['setup_s']:.1f} s", file=sys.stderr)
            for batch in [int(b) for b in args.decode_batches.split(",") if b]:
                for graphs in ("whole_step", "piecewise"):
                    whole_step = runner.whole_step_graphs
                    if graphs == "piecewise":
                        runner.whole_step_graphs = None  # the same Runner, its decode steps through the regions
                    try:
                        times = time_decode_steps(runner, batch, args.decode_context, args.decode_runs,
                                                  cfg.vocab_size, cuda)
                    finally:
                        runner.whole_step_graphs = whole_step
                    records.append({**setup, "phase": "decode", "batch": batch, "context": args.decode_context,
                                    "graphs": graphs, "median_ms": statistics.median(times), "times_ms": times})
                    print(f"  decode batch {batch} ({graphs}): {records[-1]['median_ms']:.3f} ms", file=sys.stderr)
                    save()
            for name, workload in workloads.items():
                if args.rate is not None:
                    workload = Workload(workload.num_requests, workload.prompt_len, workload.output_len, rate=args.rate)
                requests = make_requests(workload, cfg.vocab_size, args.seed)
                fallbacks_before = dict(runner.fallbacks or {})
                steps_before = dict(runner.step_counts)
                print(f"  {name}:", file=sys.stderr)
                served = serve(runner, requests, workload, args.seed, progress=True)
                records.append({**setup, "phase": "serve", "workload": name, **summarize(requests, served),
                                "concurrency": workload.concurrency, "rate": workload.rate,
                                "step_counts": {k: v - steps_before.get(k, 0) for k, v in runner.step_counts.items()},
                                "fallbacks": {k: v - fallbacks_before.get(k, 0)
                                              for k, v in (runner.fallbacks or {}).items()
                                              if v != fallbacks_before.get(k, 0)}})
                outputs.setdefault(name, {})[variant] = [r.output for r in requests]
                r = records[-1]
                print(f"  {name}: TTFT p50 {r['ttft_p50_ms']:.1f} ms, TPOT p50 {r['tpot_p50_ms']:.2f} ms, "
                      f"{r['throughput_tok_s']:.0f} tok/s", file=sys.stderr)
                save()
            del runner
            if cuda:
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - recorded; the other variant still runs
            records.append({**base, "variant": variant, "error": traceback.format_exc()})
            traceback.print_exc()
            save()
    for name, by_variant in outputs.items():
        if len(by_variant) == 2:
            a, b = by_variant.values()
            records.append({**base, "phase": "tokens", "workload": name, "requests": len(a),
                            "same_tokens": sum(x == y for x, y in zip(a, b)),
                            "same_first_token": sum(x[:1] == y[:1] for x, y in zip(a, b))})
    save()
    print(json.dumps([r for r in records if r.get("phase") != "decode"], indent=1)[:4000])


if __name__ == "__main__":
    main()
