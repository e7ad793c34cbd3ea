"""Markdown tables (and a speedup plot) from benchmark result files, for BENCHMARKS.md.

Each record needs ``model``, ``batch``, ``seq_len``, ``variant``, ``median_ms`` and ``ideal_speedup``;
speedups are over the ``--baseline`` variant of the same model and shape, in the same file.

    python3 benchmarks/tables.py benchmarks/results/2026-12-03-h200-hf-*.json --baseline inductor
    python3 benchmarks/tables.py RESULTS.json --plot speedup.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        for record in json.loads(Path(path).read_text()):
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


def markdown(rows: list[dict], baseline: str) -> str:
    lines = [f"| model | shape | variant | median ms | speedup over {baseline} | ideal | of ideal | first call s |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        shape = f"{r['batch']}x{r['seq_len']}"
        if "median_ms" not in r:
            lines.append(f"| {r['model']} | {shape} | {r['variant']} | {r.get('error', 'not run').splitlines()[-1][:60]} | | | | |")
            continue
        speedup = r["speedup"]
        shown = "" if speedup is None else f"{speedup:.2f}x"
        of_ideal = "" if speedup is None or r["variant"] == baseline else f"{speedup / r['ideal_speedup']:.2f}"
        lines.append(f"| {r['model']} | {shape} | {r['variant']} | {r['median_ms']:.1f} | {shown} | "
                     f"{r['ideal_speedup']:.2f}x | {of_ideal} | {r.get('first_call_s', 0):.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, baseline: str) -> None:
    """Speedup over the baseline per shape and variant, with the ideal as a black tick."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--baseline", default="inductor")
    parser.add_argument("--plot", help="write a speedup bar chart here (needs matplotlib)")
    args = parser.parse_args()
    rows = speedups(load(args.files), args.baseline)
    print(markdown(rows, args.baseline))
    if args.plot:
        plot(rows, args.plot, args.baseline)


if __name__ == "__main__":
    main()
