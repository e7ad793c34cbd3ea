"""One process of tests/test_program_cache.py: compile the smallest Gemma 4 with the backend,
run one batch, print what the caches did as JSON (the last line of stdout).

    python -m tests.program_cache_child [--save-artifacts PATH | --load-artifacts PATH] [--weights-seed N]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-artifacts", help="write torch.compiler.save_cache_artifacts() here after the run")
    parser.add_argument("--load-artifacts", help="torch.compiler.load_cache_artifacts() from here first")
    parser.add_argument("--weights-seed", type=int, default=0, help="the model's random weights")
    args = parser.parse_args()
    if args.load_artifacts:
        with open(args.load_artifacts, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    import fx_fastprefill
    from torch._dynamo.utils import counters
    from examples import hf_gemma4
    torch.manual_seed(args.weights_seed)
    model = hf_gemma4.smallest()
    backend = fx_fastprefill.backend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    torch.manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        logits = compiled(ids, logits_to_keep=1).logits
        expected = model(ids, logits_to_keep=1).logits
    report = backend.reports[-1]
    if args.save_artifacts:
        blob, _ = torch.compiler.save_cache_artifacts()
        with open(args.save_artifacts, "wb") as f:
            f.write(blob)
    print(json.dumps({
        "aot": dict(counters["aot_autograd"]),
        "inductor_graphs": counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"],
        "cut": report.cut, "from_cache": report.from_cache, "reason": report.reason,
        "fallbacks": dict(backend.fallbacks),
        "reduced_layers": report.reduced_layers,
        "max_abs_err": (logits - expected).abs().max().item(), "scale": expected.abs().max().item(),
    }))


if __name__ == "__main__":
    main()
