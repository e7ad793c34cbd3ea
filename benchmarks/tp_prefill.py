"""Tensor-parallel prefill, with and without the pass, in the same run (issue 20).

Launched once per rank by ``torchrun``; NCCL and bf16 on the GPU, gloo and fp32 with ``--smoke``.
Models: the flat Gemma-4-E2B-shaped example (35 layers, 20 KV-shared) sharded by examples/tp.py,
and transformers' Gemma 4 at the E2B text shape loaded with ``tp_plan="auto"`` from a random
checkpoint that rank 0 saves first. Variants: ``no_pass`` (``fast_prefill=False``: the same
compile, uncut) and ``ffp``. Per record: the median of ``--runs`` prefills (one logits row per
prompt; CUDA events, after warm-up), every timing, the ideal speedup (layers / layers that need
every row), whether each rank cut, and the first greedy token with and without the pass. Rank 0
writes the JSON; each rank's report summary goes in too.

    torchrun --nproc-per-node 2 benchmarks/tp_prefill.py --out benchmarks/results/DATE-h200x2-tp.json
    torchrun --nproc-per-node 2 benchmarks/tp_prefill.py --smoke --out /tmp/tp.json   # CPU, gloo, tiny
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fx_fastprefill  # noqa: E402
from benchmarks.timing import repeat_ms  # noqa: E402
from examples.gemma3n import Config, Gemma3nLike  # noqa: E402
from examples.tp import apply_tensor_parallel  # noqa: E402

FLAT = {"gemma4-e2b": Config(vocab_size=262144, dim=2048, n_layers=35, n_heads=8, n_kv_heads=2, head_dim=256,
                             mlp_hidden=8192, sliding_window=512, num_kv_shared_layers=20, per_layer_dim=256),
        "tiny": Config()}
VARIANTS = ("no_pass", "ffp")


def flat_runs(name: str, shapes, args, device, dtype) -> list[dict]:
    """The flat example, sharded, through the Runner: one prefill step of fresh prompts per run."""
    cfg = FLAT[name]
    torch.manual_seed(0)
    with torch.device(device):
        full = Gemma3nLike(cfg).to(dtype)
    model = apply_tensor_parallel(full)
    records = []
    max_tokens = max(b * s for b, s in shapes)
    for variant in VARIANTS:
        backend = fx_fastprefill.backend(fast_prefill=variant == "ffp",
                                         **({} if device.type == "cuda" else {"compiler": "eager"}))
        runner = fx_fastprefill.Runner(copy.deepcopy(model), backend=backend, max_num_tokens=max_tokens,
                                       max_model_len=max(s for _, s in shapes) + 8, device=device, dtype=dtype,
                                       max_num_seqs=max(b for b, _ in shapes))
        for batch, seq_len in shapes:
            prompts = [[(7 * i + j) % (cfg.vocab_size - 1) + 1 for j in range(seq_len)] for i in range(batch)]
            ms = repeat_ms(lambda r=runner, p=prompts: r.prefill(p), args.runs, cuda=device.type == "cuda")
            first = runner.prefill(prompts).argmax(-1).tolist()
            records.append(record(name, "flat", variant, batch, seq_len, cfg.n_layers, cfg.num_kv_shared_layers, ms,
                                  backend.reports[-1], first))
    return records


def hf_runs(name: str, shapes, args, device, dtype) -> list[dict]:
    """transformers' Gemma 4 with its own TP plan, compiled forward with logits_to_keep=1."""
    from transformers import AutoModelForCausalLM, Gemma4ForCausalLM

    from benchmarks.hf_generate import gemma4_e2b
    from examples import hf_gemma4
    config = gemma4_e2b() if name == "gemma4-e2b" else hf_gemma4.config()
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        Gemma4ForCausalLM(config).to(dtype).save_pretrained(path[0])
    dist.barrier()
    model = hf_gemma4.without_hand_slicing(
        AutoModelForCausalLM.from_pretrained(path[0], tp_plan="auto", dtype=dtype).eval())
    records = []
    for variant in VARIANTS:
        backend = fx_fastprefill.backend(fast_prefill=variant == "ffp",
                                         **({} if device.type == "cuda" else {"compiler": "eager"}))
        torch._dynamo.reset()
        forward = torch.compile(model.forward, backend=backend)
        for batch, seq_len in shapes:
            g = torch.Generator().manual_seed(batch * seq_len)
            ids = torch.randint(3, config.vocab_size, (batch, seq_len), generator=g).to(device)
            kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1, use_cache=False)

            def prefill():
                with torch.no_grad():
                    return forward(**kwargs).logits
            ms = repeat_ms(prefill, args.runs, cuda=device.type == "cuda")
            first = prefill()[:, -1].argmax(-1).tolist()
            records.append(record(name, "hf", variant, batch, seq_len, config.num_hidden_layers,
                                  config.num_kv_shared_layers, ms, backend.reports[-1], first))
    return records


def record(name, kind, variant, batch, seq_len, layers, shared, ms, report, first_tokens) -> dict:
    return {"model": f"{name}-{kind}-tp", "variant": variant, "batch": batch, "seq_len": seq_len,
            "world": dist.get_world_size(), "layers": layers, "shared_layers": shared,
            "ideal_speedup": layers / (layers - shared), "median_ms": statistics.median(ms), "times_ms": ms,
            "cut": report.cut, "reason": report.reason, "ranks": report.ranks, "first_tokens": first_tokens,
            "summary": report.summary(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="flat,hf")
    parser.add_argument("--shapes", default="1x8192,8x4096")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny models and shapes, 2 runs")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.runs = "1x24,2x16", 2
    cuda = not args.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    name = "tiny" if args.smoke else "gemma4-e2b"
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    records = []
    for kind in args.models.split(","):
        try:
            new = {"flat": flat_runs, "hf": hf_runs}[kind](name, shapes, args, device, dtype)
        except Exception:  # noqa: BLE001 - recorded; the other model still runs
            new = [{"model": f"{name}-{kind}-tp", "error": traceback.format_exc(limit=8)}]
        records += new
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        if dist.get_rank() == 0:
            by_rank = [{"rank": r, **rec} for r, recs in enumerate(gathered) for rec in recs]
            Path(args.out).write_text(json.dumps(by_rank, indent=1))
            for rec in new:
                print(json.dumps({k: v for k, v in rec.items() if k not in ("times_ms", "summary")}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
