"""Time to the first prefill of a transformers model, cold and warm, and where it goes.

Each (variant, cache state) runs in a fresh process: the first with an empty Inductor cache
directory (cold), the second with the directory the first left (warm: a restart). Per run: the
seconds to the first prefill's logits, Dynamo's own phase times (tracing, restarts, AOT, Inductor),
the cache counters (FX graph cache, AOTAutograd cache) and the pass pipeline's seconds.

Variants: ``plain`` (``torch.compile`` default, static shapes: transformers' compiled path),
``plain_dynamic`` (Inductor, ``dynamic=True``: the baseline of ``ffp_dynamic``), ``ffp_dynamic``
(the backend, ``dynamic=True``), ``ffp_seq`` (the backend, only the prompt length
dynamic: what ``compile_for_generate`` compiles), ``ffp_static`` (the backend, static shapes).
Every process runs with PYTHONHASHSEED=0: transformers' Gemma 4 builds its graph in the order of a
set of strings, which changes with the hash seed, and a different graph misses every cache.

    PYTHONPATH=. python3 benchmarks/compile_time.py --model gemma4-default --out compile.json
    python3 benchmarks/compile_time.py --model gemma4-tiny --device cpu --out /tmp/c.json   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "plain_dynamic", "ffp_dynamic", "ffp_seq", "ffp_static")
PHASES = ("_compile.compile_inner", "compile_attempt_0", "compile_attempt_1", "bytecode_tracing",
          "create_aot_dispatcher_function", "aot_collect_metadata", "compile_fx_inner", "fx_codegen_and_compile",
          "GraphLowering.compile_to_fn")


def build(name: str, device: str):
    """The tiny models here; the Gemma E2B-sized ones as benchmarks/hf_generate.py builds them,
    Gemma 4's hand slicing off (the pass finds the cut itself)."""
    import torch
    sys.path.insert(0, str(ROOT))
    from benchmarks.hf_generate import build as build_full
    from examples import hf_gemma3n, hf_gemma4
    torch.manual_seed(0)
    with torch.device(device):
        if name == "gemma4-tiny":
            return hf_gemma4.tiny(num_hidden_layers=12)
        if name == "gemma3n-tiny":
            return hf_gemma3n.tiny()
    model = build_full(name, device)
    return hf_gemma4.without_hand_slicing(model) if name.startswith("gemma4") else model


def child(args) -> dict:
    """One measured process: build, compile, time the first call."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters
    sys.path.insert(0, str(ROOT))
    import fx_fastprefill
    from fx_fastprefill.integrations.generate_inputs import mark_prompt_dynamic
    model = build(args.model, args.device).eval()
    if args.device == "cuda":
        model.to(torch.bfloat16)
    batch, seq = (int(x) for x in args.shape.split("x"))
    ids = torch.randint(3, model.config.get_text_config().vocab_size, (batch, seq), device=args.device)
    mask = torch.ones_like(ids)
    backend = None if args.variant.startswith("plain") else fx_fastprefill.backend()
    dynamic = {"plain": None, "plain_dynamic": True, "ffp_dynamic": True, "ffp_seq": None,
               "ffp_static": False}[args.variant]
    forward = torch.compile(model.forward, backend=backend or "inductor", dynamic=dynamic)
    if args.variant == "ffp_seq":
        mark_prompt_dynamic((), {"input_ids": ids, "attention_mask": mask})
    start = time.perf_counter()
    with torch.no_grad():
        forward(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)
    if args.device == "cuda":
        torch.cuda.synchronize()
    record = {"first_call_s": time.perf_counter() - start}
    record["phases_s"] = {k: sum(compilation_time_metrics[k]) for k in PHASES if k in compilation_time_metrics}
    record["caches"] = {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
                        if "cache" in k}
    if backend is not None:
        report = backend.reports[-1]
        record.update(cut=report.cut, reason=report.reason, pass_seconds=report.pass_seconds)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma4-default",
                        choices=["gemma4-default", "gemma4-e2b", "gemma3n-e2b", "gemma4-tiny", "gemma3n-tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="1x8192")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1, help="cold/warm pairs per variant, interleaved")
    parser.add_argument("--out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RECORD " + json.dumps(child(args)), flush=True)
        return
    records = []
    for repeat in range(args.repeats):  # interleaved: drift of the machine hits every variant alike
        for variant in args.variants.split(","):
            with tempfile.TemporaryDirectory() as cache_dir:
                for state in ("cold", "warm"):
                    records.append(_run(args, variant, state, cache_dir, repeat))
                    if args.out:
                        Path(args.out).write_text(json.dumps(records, indent=1))


def _run(args, variant: str, state: str, cache_dir: str, repeat: int) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0", TORCHINDUCTOR_CACHE_DIR=cache_dir)
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--model", args.model,
           "--device", args.device, "--shape", args.shape]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RECORD ")]
    record = {"model": args.model, "shape": args.shape, "variant": variant, "cache": state, "repeat": repeat,
              "process_s": time.perf_counter() - start}
    if lines:
        record.update(json.loads(lines[-1][len("RECORD "):]))
    else:
        record["error"] = proc.stderr[-3000:]
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
