"""Markdown tables (and a speedup plot) from benchmark result files, for BENCHMARKS.md.

Each record needs ``model``, ``batch``, ``seq_len``, ``variant``, ``median_ms`` and ``ideal_speedup``;
speedups are over the ``--baseline`` variant of the same model and shape, in the same file.

    python3 benchmarks/tables.py benchmarks/results/2026-12-03-h200-hf-*.json --baseline inductor
    python3 benchmarks/tables.py RESULTS.json --plot speedup.png
    python3 benchmarks/tables.py --serve benchmarks/results/*-serve-*e2b.json --plot serve.png
    python3 benchmarks/tables.py --roofline benchmarks/results/*-roofline-*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(paths: list[str]) -> list[dict]:
    """Every timed record; a variant that failed (an ``error`` record) is named on stderr."""
    records = []
    for path in paths:
        for record in json.loads(Path(path).read_text()):
            if "error" in record:
                last = record["error"].strip().splitlines()[-1]
                print(
                    f"{Path(path).name}: {record.get('model')} {record.get('variant')} failed: {last}", file=sys.stderr
                )
                continue
            records.append({**record, "file": Path(path).name})
    return records


def speedups(records: list[dict], baseline: str) -> list[dict]:
    """Each timed record with ``speedup`` over the baseline of its file, model and shape (None without one)."""
    base = {(r["file"], r["model"], r["batch"], r["seq_len"]): r["median_ms"]
            for r in records if r["variant"] == baseline and "median_ms" in r}
    rows = []
    for r in records:
        key = (r["file"], r["model"], r["batch"], r["seq_len"])
        speedup = base[key] / r["median_ms"] if key in base and "median_ms" in r else None
        rows.append({**r, "speedup": speedup})
    return rows


def shape_label(r: dict) -> str:
    return f"decode b{r['batch']}" if r.get("phase") == "decode" else f"{r['batch']}x{r['seq_len']}"


def compile_s(records: list[dict], model: str, variant: str) -> float | None:
    """Seconds a variant spent compiling (and capturing): its capture time, or the first calls of
    each prefill shape less one timed run (a recompile for a new shape counts too)."""
    rows = [r for r in records if r["model"] == model and r["variant"] == variant and "median_ms" in r]
    if not rows:
        return None
    if rows[0].get("compile_and_capture_s") is not None:
        return rows[0]["compile_and_capture_s"]
    return sum(max(0.0, r["first_call_s"] - r["median_ms"] / 1e3) for r in rows if "first_call_s" in r)


def targets(rows: list[dict]) -> str:
    """Issue 3's targets, each with its measured value and whether it is met."""
    lines = ["| model | target | measured | met |", "|---|---|---|---|"]
    get = {(r["model"], shape_label(r), r["variant"]): r for r in rows if "median_ms" in r}
    for model in sorted({r["model"] for r in rows}):
        for shape in ("1x8192", "8x4096"):
            r = get.get((model, shape, "ffp_cudagraph"))
            if r and r["speedup"]:
                of_ideal = r["speedup"] / r["ideal_speedup"]
                lines.append(f"| {model} | {shape}: speedup >= 0.95 x ideal {r['ideal_speedup']:.2f} | "
                             f"{r['speedup']:.2f}x = {of_ideal:.3f} of ideal | {'yes' if of_ideal >= 0.95 else 'no'} |")
        worst = max(
            (
                (get[(model, s, "ffp_cudagraph")]["median_ms"] / get[(model, s, "hand_split")]["median_ms"], s)
                for m, s, v in get
                if m == model and v == "hand_split" and (model, s, "ffp_cudagraph") in get
            ),
            default=None,
        )
        if worst:
            lines.append(
                f"| {model} | never > 1.03 x hand_split | worst {worst[0]:.3f} ({worst[1]}) | "
                f"{'yes' if worst[0] <= 1.03 else 'no'} |"
            )
        decode = [
            (get[(model, s, "ffp_cudagraph")]["median_ms"] / get[(model, s, "inductor")]["median_ms"], s)
            for m, s, v in get
            if m == model and v == "inductor" and s.startswith("decode") and (model, s, "ffp_cudagraph") in get
        ]
        if decode:
            ratio, shape = max(decode)
            lines.append(
                f"| {model} | decode with the backend <= 1.02 x without | worst {ratio:.3f} ({shape}) | "
                f"{'yes' if ratio <= 1.02 else 'no'} |"
            )
        ours, theirs = compile_s(rows, model, "ffp_cudagraph"), compile_s(rows, model, "inductor")
        if ours is not None and theirs:
            lines.append(
                f"| {model} | compile + capture <= 1.5 x inductor's | {ours:.0f} s vs {theirs:.0f} s = "
                f"{ours / theirs:.2f}x | "
                f"{'yes' if ours <= 1.5 * theirs else 'no'} |"
            )
    return "\n".join(lines)


def markdown(rows: list[dict], baseline: str) -> str:
    lines = [f"| model | shape | variant | median ms | speedup over {baseline} | ideal | of ideal | first call s |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        shape = shape_label(r)
        if "median_ms" not in r:
            lines.append(
                f"| {r['model']} | {shape} | {r['variant']} | {r.get('error', 'not run').splitlines()[-1][:60]} | | "
                "| | |"
            )
            continue
        speedup = r["speedup"]
        shown = "" if speedup is None else f"{speedup:.2f}x"
        decode = r.get("phase") == "decode"  # no rows to drop: the ideal does not apply
        of_ideal = (
            "" if speedup is None or r["variant"] == baseline or decode else f"{speedup / r['ideal_speedup']:.2f}"
        )
        ideal = "" if decode else f"{r['ideal_speedup']:.2f}x"
        lines.append(f"| {r['model']} | {shape} | {r['variant']} | {r['median_ms']:.1f} | {shown} | "
                     f"{ideal} | {of_ideal} | {r.get('first_call_s', 0):.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, baseline: str) -> None:
    """Speedup over the baseline per shape and variant, with the ideal as a black tick."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r.get("phase") != "decode"]
    shapes = sorted({(r["model"], r["batch"], r["seq_len"]) for r in rows if r["speedup"] is not None})
    variants = sorted({r["variant"] for r in rows if r["speedup"] is not None and r["variant"] != baseline})
    by = defaultdict(dict)
    for r in rows:
        if r["speedup"] is not None:
            by[(r["model"], r["batch"], r["seq_len"])][r["variant"]] = r
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(shapes)), 4))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        xs = [j + i * width for j, s in enumerate(shapes) if variant in by[s]]
        ys = [by[s][variant]["speedup"] for s in shapes if variant in by[s]]
        ax.bar(xs, ys, width, label=variant)
    for j, s in enumerate(shapes):
        ideal = next(iter(by[s].values()))["ideal_speedup"]
        ax.hlines(ideal, j - width / 2, j + 0.8 - width / 2, colors="black", label="ideal" if j == 0 else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"{m}\n{b}x{t}" for m, b, t in shapes], fontsize=8)
    ax.set_ylabel(f"speedup over {baseline}")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


# Issue 21's targets: decode step ms (Gemma-3n-E2B shape) per batch, TTFT ratio per model, TPOT ratio.
DECODE_TARGET_MS = {1: 2.0, 64: 4.0}
TTFT_TARGET = {"gemma3n-e2b": 0.70, "gemma4-e2b": 0.48}
TPOT_TARGET = 1.02


def serve_markdown(records: list[dict]) -> str:
    """benchmarks/serve.py's records: the workloads with and without the pass, then the decode steps."""
    serve = {(r["model"], r["workload"], r["variant"]): r for r in records if r.get("phase") == "serve"}
    lines = ["| model | workload | variant | TTFT p50 ms | TTFT p99 | TPOT p50 ms | TPOT p99 | output tok/s | "
             "TTFT p50 / no_pass (ideal) | TPOT p50 / no_pass |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, workload, variant), r in sorted(serve.items()):
        base = serve.get((model, workload, "no_pass"))
        ttft = f"{r['ttft_p50_ms'] / base['ttft_p50_ms']:.3f} ({r['ideal_ttft_ratio']:.2f})" if base else ""
        tpot = f"{r['tpot_p50_ms'] / base['tpot_p50_ms']:.3f}" if base else ""
        lines.append(f"| {model} | {workload} | {variant} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                     f"{r['tpot_p50_ms']:.2f} | {r['tpot_p99_ms']:.2f} | {r['throughput_tok_s']:.0f} | "
                     f"{ttft} | {tpot} |")
    lines += ["", "| model | variant | decode batch | whole-step graph ms | piecewise ms |", "|---|---|---|---|---|"]
    decode = defaultdict(dict)
    for r in records:
        if r.get("phase") == "decode":
            decode[(r["model"], r["variant"], r["batch"])][r["graphs"]] = r["median_ms"]
    for (model, variant, batch), by in sorted(decode.items()):
        lines.append(f"| {model} | {variant} | {batch} | {by.get('whole_step', float('nan')):.2f} | "
                     f"{by.get('piecewise', float('nan')):.2f} |")
    return "\n".join(lines)


def serve_targets(records: list[dict]) -> str:
    """Issue 21's targets, met or not, from benchmarks/serve.py's records."""
    lines = ["| model | target | measured | met |", "|---|---|---|---|"]
    for r in records:
        if (r.get("phase") == "decode" and r["graphs"] == "whole_step" and r["variant"] == "ffp"
                and r["model"] == "gemma3n-e2b" and r["batch"] in DECODE_TARGET_MS):
            limit = DECODE_TARGET_MS[r["batch"]]
            lines.append(f"| {r['model']} | decode step, batch {r['batch']} <= {limit} ms | {r['median_ms']:.2f} ms | "
                         f"{'yes' if r['median_ms'] <= limit else 'no'} |")
    serve = {(r["model"], r["workload"], r["variant"]): r for r in records if r.get("phase") == "serve"}
    for (model, workload, variant), r in sorted(serve.items()):
        base = serve.get((model, workload, "no_pass"))
        if variant != "ffp" or base is None:
            continue
        if workload == "vllm-8k" and model in TTFT_TARGET:
            ratio = r["ttft_p50_ms"] / base["ttft_p50_ms"]
            lines.append(f"| {model} | {workload} TTFT p50 <= {TTFT_TARGET[model]} x no_pass | {ratio:.3f} | "
                         f"{'yes' if ratio <= TTFT_TARGET[model] else 'no'} |")
        ratio = r["tpot_p50_ms"] / base["tpot_p50_ms"]
        lines.append(f"| {model} | {workload} TPOT p50 <= {TPOT_TARGET} x no_pass | {ratio:.3f} | "
                     f"{'yes' if ratio <= TPOT_TARGET else 'no'} |")
    return "\n".join(lines)


def serve_plot(records: list[dict], path: str) -> None:
    """TTFT and TPOT p50 per model and workload, with and without the pass."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    serve = {(r["model"], r["workload"], r["variant"]): r for r in records if r.get("phase") == "serve"}
    groups = sorted({(m, w) for m, w, _ in serve})
    fig, axes = plt.subplots(1, 2, figsize=(max(7, 2.2 * len(groups)), 3.6))
    for ax, metric, label in ((axes[0], "ttft_p50_ms", "TTFT p50 (ms)"), (axes[1], "tpot_p50_ms", "TPOT p50 (ms)")):
        for i, variant in enumerate(("no_pass", "ffp")):
            xs = [j + 0.4 * i for j, g in enumerate(groups) if (*g, variant) in serve]
            ys = [serve[(*g, variant)][metric] for g in groups if (*g, variant) in serve]
            ax.bar(xs, ys, 0.4, label=variant)
        ax.set_xticks([j + 0.2 for j in range(len(groups))])
        ax.set_xticklabels([f"{m}\n{w}" for m, w in groups], fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


# Issue 41's targets: the cut program's share of the card's peak in prefill, its decode step times.
PREFILL_MFU_TARGET = 0.55
ROOFLINE_DECODE_TARGET_MS = {"decode b1": 2.0, "decode b16": 2.6}
BANDWIDTH_GOAL = 0.6


def roofline_markdown(records: list[dict]) -> str:
    """benchmarks/roofline.py's records: "Of the limit", one row per model, shape and variant."""
    lines = ["| model | shape | variant | step ms | TFLOP | TFLOP/s | mfu | GB | GB/s | of_bandwidth_bound | card |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        if "step_ms" not in r:
            continue
        lines.append(f"| {r['model']} | {r['shape']} | {r['variant']} | {r['step_ms']:.2f} | {r['tflop']:.2f} | "
                     f"{r['achieved_tflops']:.0f} | {r['mfu']:.3f} | {r['gbytes']:.2f} | {r['achieved_gbps']:.0f} | "
                     f"{r['of_bandwidth_bound']:.3f} | {r['device_name']} |")
    return "\n".join(lines)


def roofline_targets(records: list[dict], variant: str = "ffp_cudagraph") -> str:
    """Issue 41's targets, met or not: prefill mfu of the cut program, decode step ms and bandwidth share."""
    lines = ["| model | target | measured | met |", "|---|---|---|---|"]
    for r in records:
        if r.get("variant") != variant or "step_ms" not in r:
            continue
        if r["phase"] == "prefill":
            met = r["mfu"] >= PREFILL_MFU_TARGET
            lines.append(f"| {r['model']} | {r['shape']} mfu >= {PREFILL_MFU_TARGET} | {r['mfu']:.3f} | "
                         f"{'yes' if met else 'no'} |")
        elif r["shape"] in ROOFLINE_DECODE_TARGET_MS:
            limit = ROOFLINE_DECODE_TARGET_MS[r["shape"]]
            lines.append(f"| {r['model']} | {r['shape']} <= {limit} ms | {r['step_ms']:.2f} ms | "
                         f"{'yes' if r['step_ms'] <= limit else 'no'} |")
            share = r["of_bandwidth_bound"]
            lines.append(f"| {r['model']} | {r['shape']} of_bandwidth_bound >= {BANDWIDTH_GOAL} (goal) | "
                         f"{share:.3f} | {'yes' if share >= BANDWIDTH_GOAL else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--baseline", default="inductor")
    parser.add_argument("--plot", help="write a speedup bar chart of the prefill shapes here (needs matplotlib)")
    parser.add_argument("--targets", action="store_true", help="also print issue 3's targets, met or not")
    parser.add_argument("--serve", action="store_true", help="files of benchmarks/serve.py: its tables and targets")
    parser.add_argument("--roofline", action="store_true", help="files of benchmarks/roofline.py: its table, targets")
    args = parser.parse_args()
    if args.roofline:
        records = load(args.files)
        print(roofline_markdown(records) + "\n\n" + roofline_targets(records))
        return
    if args.serve:
        records = load(args.files)
        print(serve_markdown(records) + "\n\n" + serve_targets(records))
        if args.plot:
            serve_plot(records, args.plot)
        return
    rows = speedups(load(args.files), args.baseline)
    print(markdown(rows, args.baseline))
    if args.targets:
        print()
        print(targets(rows))
    if args.plot:
        plot(rows, args.plot, args.baseline)


if __name__ == "__main__":
    main()
