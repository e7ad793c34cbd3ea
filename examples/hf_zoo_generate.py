"""``compile_for_generate`` on every architecture of the zoo, by hand (CI runs three: tests/test_generate.py).

For each architecture and cache (static, dynamic): greedy ``generate`` of 3 left-padded batches of
other prompt lengths, fp32, against the same model uncompiled; tokens equal, prefill cut, graphs
compiled per path. Prefill regions and decode run without Inductor (what is checked is the dispatch
and the cut).

    python examples/hf_zoo_generate.py --json docs/results/DATE-cpu-hf-zoo-generate.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fx_fastprefill  # noqa: E402
from examples.hf_check import left_padded_batch  # noqa: E402
from examples.hf_zoo import ARCHITECTURES  # noqa: E402

BATCHES = [[10, 7], [13, 12], [9, 11]]


def greedy(model, cache: str) -> list[torch.Tensor]:
    vocab = model.config.get_text_config().vocab_size
    outs = []
    for seed, lengths in enumerate(BATCHES):
        ids, mask = left_padded_batch(lengths, vocab, pad_id=0, seed=seed)
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                       pad_token_id=0, do_sample=False, cache_implementation=cache))
    return outs


def check(name: str, cache: str) -> dict:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = ARCHITECTURES[name][1]()
    start = time.perf_counter()
    try:
        expected = greedy(model, cache)
        fx_fastprefill.compile_for_generate(model, compiler="eager", decode_backend="eager")
        got = greedy(model, cache)
        handle = model.fx_fastprefill
        record = dict(tokens_equal=all(torch.equal(a, b) for a, b in zip(got, expected)), compiles=handle.compiles,
                      cut=[r.cut for r in handle.reports], reasons=[r.reason for r in handle.reports])
    except Exception as e:  # noqa: BLE001 - recorded; the other architectures still run
        record = dict(error=f"{type(e).__name__}: {e}"[:300])
    return dict(model=name, cache=cache, **record, seconds=round(time.perf_counter() - start, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    records = []
    for name in ARCHITECTURES:
        for cache in ("static", "dynamic"):
            records.append(check(name, cache))
            print(json.dumps(records[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    ok = all(r.get("tokens_equal") and r.get("cut") and all(r["cut"]) for r in records)
    print(f"{sum(1 for r in records if r.get('tokens_equal'))}/{len(records)} equal; all cut and equal: {ok}")


if __name__ == "__main__":
    main()
