"""How many CUDA-graph pieces the backend compiles, and what its first step costs, on the CPU.

The flat example at the layer layouts of ``prefill.py``'s models (Gemma 3n E2B: 30 layers, the last
10 reading earlier K/V; Gemma 4 E2B: 35 and 20) with small widths, compiled with piecewise CUDA
graphs. The CPU has no graphs, so a stand-in recorder takes their place; the first step only warms
up (it records nothing), so the split, the compiles and Inductor run as they do on the GPU. Each
run is a fresh process with an empty Inductor cache (a cold start); ``--warm`` then runs a second
process on the cache the first left (a restart: the program loads from the cache). Variants: ``ffp`` (the backend
as above) and ``inductor`` (``backend="inductor"``: Inductor's first compile of the same model, no
pieces, the baseline of the issue's "cold setup <= 1.2x Inductor"). ``--checkouts`` runs the same
measurement with other checkouts of the package first on the path, interleaved run by run (an A/B
against earlier code).

    PYTHONPATH=. python3 benchmarks/piece_compiles.py --out OUT.json
    PYTHONPATH=. python3 benchmarks/piece_compiles.py --checkouts head=.,before=/tmp/old --variants ffp --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"gemma3n-e2b": (30, 10), "gemma4-e2b": (35, 20)}  # (layers, layers reading earlier K/V)


class _WarmUpOnly:
    """The recorder of a first step: it warms up every piece and records none."""

    def new_pool(self) -> None:
        return None

    def capture(self, fn, args, pool):
        raise RuntimeError("the first step records no graph")

    @staticmethod
    def alias(t):
        return t


def measure(model_name: str, variant: str) -> dict:
    """One first step in this process: pieces, distinct compiles, seconds."""
    import torch
    import fx_fastprefill
    from fx_fastprefill import SeqChunk
    from fx_fastprefill.compilation import cudagraphs
    from fx_fastprefill.compilation.backend import FastPrefillBackend
    from examples.gemma3n import Config, Gemma3nLike

    pieces, compiles = [], []
    piece_init, compile_boxed = cudagraphs.CUDAGraphPiece.__init__, cudagraphs.compile_boxed
    cudagraphs.CUDAGraphPiece.__init__ = lambda self, *a: pieces.append(1) or piece_init(self, *a)
    cudagraphs.compile_boxed = lambda *a: compiles.append(1) or compile_boxed(*a)
    layers, shared = LAYOUTS[model_name]
    torch.manual_seed(0)
    model = Gemma3nLike(Config(n_layers=layers, num_kv_shared_layers=shared))
    backend = FastPrefillBackend(cudagraphs=True) if variant == "ffp" else "inductor"
    runner = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=64, max_model_len=96,
                                   token_pad_sizes=[16, 32, 64], graph_recorder=_WarmUpOnly())
    start = time.perf_counter()
    runner.step([SeqChunk(0, list(range(1, 15)), 1), SeqChunk(1, list(range(5, 25)), 1)])
    seconds = time.perf_counter() - start
    report = runner.report
    return {"model": model_name, "variant": variant, "layers": layers, "kv_shared_layers": shared,
            "cut": report.cut if report else None, "graph_pieces": len(pieces), "compiled_pieces": len(compiles),
            "first_step_s": round(seconds, 2),
            "pass_s": {k: round(v, 3) for k, v in report.pass_seconds.items()} if report else {}}


def run_children(checkout: Path, model_name: str, variant: str, phases: list[str]) -> list[dict]:
    """One process per phase on one fresh cache folder: cold, then (if asked) warm."""
    results = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(ROOT)]),
               "TORCHINDUCTOR_CACHE_DIR": cache}
        for phase in phases:
            out = subprocess.run([sys.executable, __file__, "--child", model_name, "--variants", variant], env=env,
                                 capture_output=True, text=True, check=True)
            results.append({"phase": phase, **json.loads(out.stdout.strip().splitlines()[-1])})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(LAYOUTS))
    parser.add_argument("--variants", default="ffp,inductor")
    parser.add_argument("--checkouts", default="head=.", help="name=path,...: the package from each path")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="a second, warm process after each cold one")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.variants)))
        return
    checkouts = dict(item.split("=", 1) for item in args.checkouts.split(","))
    cases = [(m, v, c) for m in args.models.split(",") for v in args.variants.split(",") for c in checkouts]
    phases = ["cold", "warm"] if args.warm else ["cold"]
    runs = []
    for repeat in range(args.repeats):
        for model_name, variant, name in cases:
            for result in run_children(Path(checkouts[name]).resolve(), model_name, variant, phases):
                result = {"checkout": name, "repeat": repeat, **result}
                print(json.dumps(result), flush=True)
                runs.append(result)
    summary = []
    for (model_name, variant, name), phase in [(case, phase) for case in cases for phase in phases]:
        mine = [r for r in runs if (r["model"], r["variant"], r["checkout"], r["phase"]) ==
                (model_name, variant, name, phase)]
        summary.append({"model": model_name, "variant": variant, "checkout": name, "phase": phase,
                        "graph_pieces": mine[0]["graph_pieces"], "compiled_pieces": mine[0]["compiled_pieces"],
                        "first_step_s_median": statistics.median(r["first_step_s"] for r in mine),
                        "runs": [r["first_step_s"] for r in mine], "cut": [r["cut"] for r in mine]})
    for row in summary:
        print(row)
    if args.out:
        import torch
        meta = {"device": "cpu", "cpus": os.cpu_count(), "torch": torch.__version__, "checkouts": checkouts,
                "command": " ".join(sys.argv)}
        args.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
