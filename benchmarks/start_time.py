"""Time to the first output of a fresh process, cold and warm (issue "Start in seconds").

Each (model, variant, phase) runs in a process of its own. ``cold``: an empty Inductor cache
directory; ``warm``: the directory the cold process left (a restart). The model is built before
the clock starts (weights in memory); what is timed is what a user waits for after that.

- ``generate`` models (transformers, as ``benchmarks/hf_generate.py`` builds them): the first
  ``model.generate(max_new_tokens=1)`` (prefill and the first token). Variants: ``plain_dynamic``
  (the prefill under plain ``torch.compile`` with the same dynamic marks as ``compile_for_generate``,
  the decode path the same), ``plain_static`` (the prefill with static shapes), ``ffp``
  (``fx_fastprefill.compile_for_generate``) and ``ffp_precompiled`` (``compile_for_generate(
  precompile=True)``: both paths saved whole in the cache folder; the warm process loads them
  without Dynamo).
- ``runner`` models (the flat example at Gemma E2B shapes, as ``benchmarks/prefill.py`` builds
  them): ``Runner(...)``, ``capture()`` (with CUDA graphs, on CUDA) and one prefill step. Variants:
  ``inductor`` (``backend="inductor"``, no graphs to capture: Inductor's first compile of the same
  model, the issue's baseline), ``plain`` (``fx_fastprefill.backend(fast_prefill=False)``: the same
  regions and graphs without the cut), ``ffp`` and ``ffp_precompiled`` (``Runner(precompile=True)``:
  the compiled model saved whole; the warm process loads it without Dynamo).

Records ``{model, device, variant, phase, first_output_s, compile_s, capture_s}`` (``compile_s``:
Dynamo's own compile time, every graph; ``capture_s``: the Runner's capture) plus the cache
counters. Every process runs with PYTHONHASHSEED=0 (Gemma 4's graph follows a set's order) and
writes bytecode caches as Python does by default (PYTHONDONTWRITEBYTECODE removed).
Each record also holds ``timed``: the seconds of every phase torch times (``dynamo_timed``: Dynamo's
trace, AOT, Inductor, loading compiled code and Triton kernels), and ``kernels_autotuned``: how many
Triton kernels were autotuned at their first launch (none, on a warm start that finds the cold
one's results), ``fallbacks`` (the backend's, by reason), ``precompiled`` (each saved path's state:
loaded, compiled, or why it fell back) and ``stderr_tail`` (what the process logged last).
``--profile DIR`` adds a third process per variant, a warm one with cProfile over the timed
window (its record's phase ``warm_profiled``; the profiler slows it, so the ``warm`` record stays
the number), and writes its most expensive calls, by cumulative and by own time, to
``DIR/<model>-<variant>-warm_profiled.txt``: where a warm start's seconds go.

    PYTHONPATH=. python3 benchmarks/start_time.py --models gemma4-e2b,gemma3n-e2b,runner-gemma3n-e2b \\
        --out benchmarks/results/DATE-h200-start-time.json
    PYTHONPATH=. python3 benchmarks/start_time.py --smoke --out /tmp/start.json   # CPU, tiny models
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATE_VARIANTS = ("plain_dynamic", "plain_static", "ffp", "ffp_precompiled")
RUNNER_VARIANTS = ("inductor", "plain", "ffp", "ffp_precompiled")
SMOKE_MODELS = ("gemma4-tiny", "runner-tiny")


PROFILER = None  # a child's cProfile.Profile under --profile: it runs over the timed window only


def device_name(device: str) -> str:
    """The card each record names (torch.cuda.get_device_name), or "cpu"."""
    import torch
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def _clock_starts() -> float:
    if PROFILER is not None:
        PROFILER.enable()
    return time.perf_counter()


def _clock_stops(start: float) -> float:
    seconds = time.perf_counter() - start
    if PROFILER is not None:
        PROFILER.disable()
    return seconds


def _generate_model(name: str, device: str):
    import torch
    from benchmarks.hf_generate import build
    from examples import hf_gemma4
    if name in ("gemma4-tiny", "gemma4-e2b-layout"):
        torch.manual_seed(0)
        # the layout: Gemma 4 E2B's 35 layers (20 reading earlier K/V, one K/V head) at small widths
        layout = dict(num_hidden_layers=35, num_kv_shared_layers=20, num_key_value_heads=1,
                      layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7)
        with torch.device(device):
            return hf_gemma4.tiny(**(layout if name == "gemma4-e2b-layout" else dict(num_hidden_layers=12)))
    model = build(name, device)  # Gemma 4 with its hand slicing off, as hf_generate.py's compiled variants
    return hf_gemma4.without_hand_slicing(model) if name.startswith("gemma4") else model


def _first_generate(args) -> dict:
    import torch
    import fx_fastprefill
    from fx_fastprefill.integrations.generate import GenerateForward
    model = _generate_model(args.model, args.device).eval()
    if args.device == "cuda":
        model.to(torch.bfloat16)
    batch, seq = (int(x) for x in args.shape.split("x"))
    ids = torch.randint(3, model.config.get_text_config().vocab_size, (batch, seq), device=args.device)
    start = _clock_starts()
    if args.variant.startswith("ffp"):
        fx_fastprefill.compile_for_generate(model, precompile=args.variant == "ffp_precompiled")
    else:  # the same dispatch, the prefill under plain torch.compile
        model.generation_config.disable_compile = True
        forward = GenerateForward(model, "inductor", "inductor", True)
        forward.prompt_dynamic = args.variant == "plain_dynamic"
        model.forward = forward
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                       pad_token_id=0, cache_implementation="static")
    if args.device == "cuda":
        torch.cuda.synchronize()
    record = {"first_output_s": _clock_stops(start), "capture_s": 0.0}
    handle = getattr(model, "fx_fastprefill", None)
    if handle is not None:
        record["cut"] = all(r.cut for r in handle.reports)
        record.update(_fallbacks(handle.backend.fallbacks, handle.forward.precompiled.values()))
    return record


def _fallbacks(counter, precompiled_functions) -> dict:
    """The backend's fallbacks by reason, and each precompiled path's state (why it fell back to
    torch.compile, if it did): a slow cold or warm start says why in its record."""
    return {"fallbacks": dict(counter or {}),
            "precompiled": {f.name: f.state() for f in precompiled_functions}}


def _first_step(args) -> dict:
    import torch
    import fx_fastprefill
    from benchmarks.prefill import MODELS
    from examples.gemma3n import Config, Gemma3nLike
    cfg = Config(n_layers=6, pattern=3, num_kv_shared_layers=2) if args.model == "runner-tiny" \
        else MODELS[args.model.removeprefix("runner-")]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = Gemma3nLike(cfg).to(dtype)
    batch, seq = (int(x) for x in args.shape.split("x"))
    start = _clock_starts()
    graphs = args.device == "cuda" and args.variant != "inductor"
    backend = "inductor" if args.variant == "inductor" else \
        fx_fastprefill.backend(fast_prefill=args.variant.startswith("ffp"), cudagraphs=graphs)
    runner = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=batch * seq, max_model_len=seq + 16,
                                   max_num_seqs=batch, device=args.device, dtype=dtype,
                                   precompile=args.variant == "ffp_precompiled")
    capture_s = runner.capture(progress=False) if graphs else 0.0
    runner.prefill([[3 + (i * 7 + j) % (cfg.vocab_size - 3) for j in range(seq)] for i in range(batch)])
    if args.device == "cuda":
        torch.cuda.synchronize()
    record = {"first_output_s": _clock_stops(start), "capture_s": capture_s}
    if runner.report is not None:
        record["cut"] = runner.report.cut
    record.update(_fallbacks(runner.fallbacks, [runner.precompiled] if runner.precompiled else []))
    return record


def child(args) -> dict:
    from torch._dynamo.utils import compilation_time_metrics, counters
    sys.path.insert(0, str(ROOT))
    record = (_first_step if args.model.startswith("runner-") else _first_generate)(args)
    # Dynamo's compiles: through its frame hook, or ahead of time (aot_compile's capture)
    record["compile_s"] = sum(sum(compilation_time_metrics.get(key, []))
                              for key in ("_compile.compile_inner", "fullgraph_capture"))
    record["caches"] = {f"{group}.{k}": v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
                        if "cache" in k or "triton_bundler" in k}
    # every phase torch timed (Triton kernels loaded from the bundle or compiled, code loaded, ...), seconds
    record["timed"] = {key: round(sum(times), 4) for key, times in compilation_time_metrics.items()}
    # Triton kernels autotuned at their first launch (a warm start should find the cold one's results)
    record["kernels_autotuned"] = len(compilation_time_metrics.get("CachingAutotuner.benchmark_all_configs", []))
    return record


def profile_child(args) -> None:
    """:func:`child` with cProfile over its timed window (not the model's build or the imports
    before it); the listing (by cumulative, then by own time) goes to ``args.profile``, the record
    to stdout."""
    import cProfile
    import io
    import pstats
    global PROFILER
    PROFILER = cProfile.Profile()
    record = child(args)
    record["dont_write_bytecode"] = sys.dont_write_bytecode  # each import compiles its source again
    listing = io.StringIO()
    pstats.Stats(PROFILER, stream=listing).sort_stats("cumulative").print_stats(80)
    pstats.Stats(PROFILER, stream=listing).sort_stats("tottime").print_stats(40)
    folder = Path(args.profile)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{args.model}-{args.variant}-{args.phase}.txt").write_text(listing.getvalue())
    print("RECORD " + json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gemma4-e2b,gemma3n-e2b,runner-gemma3n-e2b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default=None, help="BxT (default 1x8192; 1x64 with --smoke)")
    parser.add_argument("--variants", default=None, help="a subset, comma-separated (default: all of a model's)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models: a check of the script")
    parser.add_argument("--out")
    parser.add_argument("--profile", help="a folder: each process's cProfile listing, by cumulative time")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        if args.profile:
            profile_child(args)
        else:
            print("RECORD " + json.dumps(child(args)), flush=True)
        return
    if args.smoke:
        args.models, args.device = ",".join(SMOKE_MODELS), "cpu"
    shape = args.shape or ("1x64" if args.smoke else "1x8192")
    records = []
    for model in args.models.split(","):
        variants = RUNNER_VARIANTS if model.startswith("runner-") else GENERATE_VARIANTS
        for variant in [v for v in variants if args.variants is None or v in args.variants.split(",")]:
            with tempfile.TemporaryDirectory() as cache_dir:
                for phase in ("cold", "warm", *(["warm_profiled"] if args.profile else [])):
                    env = dict(os.environ, PYTHONHASHSEED="0", TORCHINDUCTOR_CACHE_DIR=cache_dir,
                               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
                    # Python's default: a module imported without a .pyc is compiled once and cached,
                    # not at every start (where the variable is set, every process compiles again the
                    # sources of packages installed without bytecode)
                    env.pop("PYTHONDONTWRITEBYTECODE", None)
                    cmd = [sys.executable, __file__, "--child", "--model", model, "--variant", variant,
                           "--device", args.device, "--shape", shape, "--phase", phase,
                           *(["--profile", args.profile] if phase == "warm_profiled" else [])]
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    lines = [x for x in proc.stdout.splitlines() if x.startswith("RECORD ")]
                    record = {"model": model, "device": args.device, "device_name": device_name(args.device),
                              "shape": shape, "variant": variant, "phase": phase}
                    record.update(json.loads(lines[-1][len("RECORD "):]) if lines else {"error": proc.stderr[-3000:]})
                    # the end of what the process logged (a fallback's reason, a cache that could not save)
                    record["stderr_tail"] = proc.stderr.splitlines()[-30:]
                    shown = {k: v for k, v in record.items() if k not in ("caches", "timed", "stderr_tail")}
                    print(json.dumps(shown), flush=True)
                    records.append(record)
                    if args.out:
                        meta = {"argv": sys.argv[1:], "python": sys.version.split()[0]}
                        Path(args.out).write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
