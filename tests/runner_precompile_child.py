"""One process of tests/test_precompiled.py's Runner restart: ``Runner(precompile=FOLDER)`` on a
small flat model with piecewise graphs (the CPU stand-in recorder), captured, then the steps of
tests/helpers.py (STEPS), compared with the model run without the pass or graphs; prints what was
traced, loaded and compiled as JSON (the last line of stdout).

    python -m tests.runner_precompile_child FOLDER [--weights-seed N] [--cuda]

``--cuda``: on the GPU with Inductor's pieces and real CUDA graphs (no stand-in).
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--weights-seed", type=int, default=0, help="the model's random weights")
    parser.add_argument("--cuda", action="store_true", help="real CUDA graphs of Inductor's pieces")
    args = parser.parse_args()
    import fx_fastprefill
    from fx_fastprefill.compilation.backend import FastPrefillBackend
    from examples.gemma3n import Config, Gemma3nLike
    from tests.helpers import STEPS, RerunRecorder
    from torch._dynamo.utils import counters

    def runner(backend, **options):
        torch.manual_seed(args.weights_seed)
        model = Gemma3nLike(Config(n_layers=5, pattern=3, num_kv_shared_layers=2, sliding_window=5))
        return fx_fastprefill.Runner(model, backend=backend, max_num_tokens=64, max_model_len=96,
                                     device="cuda" if args.cuda else "cpu", **options)

    recorder = None if args.cuda else RerunRecorder()
    backend = FastPrefillBackend(compiler="inductor" if args.cuda else "eager", cudagraphs=True)
    saved = runner(backend, precompile=args.folder, token_pad_sizes=[16, 48, 64], graph_recorder=recorder)
    saved.capture(progress=False)
    graphs = counters["stats"]["unique_graphs"]
    logits = [saved.step(chunks) for chunks in STEPS]
    reference = runner(None)
    expected = [reference.step(chunks) for chunks in STEPS]
    function = saved.precompiled
    print(json.dumps({
        "graphs": graphs, "loaded": function.loaded, "compiled": function.compiled, "failed": function.failed,
        "max_abs_err": max((a - b).abs().max().item() for a, b in zip(logits, expected)),
        "cut": saved.report.cut, "from_cache": saved.report.from_cache,
        "replays": recorder.replays if recorder else None,
        "fallbacks": dict(backend.fallbacks),
    }))


if __name__ == "__main__":
    main()
