"""``python -m fx_fastprefill explain MODULE:FACTORY``: what the pass does to a model, and why.

The factory is any callable returning a model in one of the two conventions: a flat-batch model
(``forward(input_ids, positions, logits_indices)``, run through the Runner) or a transformers
causal LM (``forward(input_ids, ..., logits_to_keep)``, called with ``logits_to_keep=1``). The model
is compiled on the CPU with a small batch; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from . import torch_seams
from .compilation.backend import backend as make_backend
from .report.picture import PictureUnavailable, draw_cut
from .report.printer import print_cut_graph
from .report.report import FastPrefillReport
from .runtime.runner import Runner, vocab_size_of


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """'package.module:callable' -> the callable (the current directory is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY (e.g. examples.gemma3n:tiny), got {spec!r}")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of {spec!r}: {e}") from e
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"{spec!r} is not callable")
    return factory


def convention(model: nn.Module) -> str:
    """'flat' or 'transformers', from the forward signature."""
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        return "transformers"
    if {"input_ids", "positions", "logits_indices"} <= set(params):
        return "flat"
    raise ValueError(
        f"{type(model).__name__}.forward takes ({', '.join(params)}): expected the flat convention "
        "forward(input_ids, positions, logits_indices) or a transformers causal LM with logits_to_keep")


def compile_and_report(
    model: nn.Module,
    *,
    prompt_len: int = 2048,
    draft_layers: tuple[str, ...] = (),
    compiler: str = "eager",
    prompt_tokens: int = 12,
    num_prompts: int = 2,
) -> list[FastPrefillReport]:
    """Compile ``model`` with the pass on the CPU, run one small prefill, return its reports.

    The cut does not depend on how the regions are compiled afterwards, so by default they run
    eagerly (``compiler="eager"``): explaining a model takes seconds, not an Inductor build. The
    passes always run (the AOTAutograd cache off): a program loaded from it keeps no graph to print.
    """
    with torch_seams.functorch_config.patch(enable_autograd_cache=False):
        return _compile_and_report(model, prompt_len, draft_layers, compiler, prompt_tokens, num_prompts)


def _compile_and_report(model: nn.Module, prompt_len: int, draft_layers: tuple[str, ...], compiler: str,
                        prompt_tokens: int, num_prompts: int) -> list[FastPrefillReport]:
    backend = make_backend(draft_layers=draft_layers, prompt_len=prompt_len, compiler=compiler)
    vocab = vocab_size_of(model)
    if vocab is None:
        raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__}: give it a vocab_size attribute")
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_tokens - k)] for k in range(num_prompts)]
    if convention(model) == "flat":
        runner = Runner(
            model, backend=backend, max_num_tokens=4 * prompt_tokens * num_prompts, max_model_len=4 * prompt_tokens
        )
        runner.prefill(prompts)
    else:
        model = model.eval()
        compiled = torch.compile(model, backend=backend, dynamic=True)
        with torch.no_grad():
            compiled(input_ids=torch.tensor([prompts[0]]), logits_to_keep=1, use_cache=False)
    if not backend.reports:
        raise RuntimeError("the model compiled to no graph: nothing to explain")
    return backend.reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fx_fastprefill explain",
        description="Compile a model with the fast-prefill pass on the CPU and show what it did.",
    )
    parser.add_argument(
        "factory", metavar="MODULE:FACTORY", help="a callable returning a model, e.g. examples.gemma3n:tiny"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=2048, help="prompt length of the FLOPs estimate (default 2048)"
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--draft-layers", nargs="*", default=(), help="layers to treat as draft layers")
    parser.add_argument("--compiler", choices=("eager", "inductor"), default="eager",
                        help="how the cut regions are compiled (the cut is the same; default eager, fast)")
    parser.add_argument("--graph", action="store_true", help="also print the cut aten graph, region by region")
    picture = parser.add_mutually_exclusive_group()
    picture.add_argument("--svg", metavar="PATH", help="draw the cut to an SVG file")
    picture.add_argument("--png", metavar="PATH", help="draw the cut to a PNG file")
    args = parser.parse_args(argv)
    if args.prompt_len < 1:
        parser.error(f"--prompt-len must be a positive number of tokens, got {args.prompt_len}")
    try:
        model = load_factory(args.factory)()
        if not isinstance(model, nn.Module):
            raise ValueError(f"{args.factory} returned {type(model).__name__}, expected a torch.nn.Module")
        reports = compile_and_report(model, prompt_len=args.prompt_len, draft_layers=tuple(args.draft_layers),
                                     compiler=args.compiler)
    except ValueError as e:
        parser.error(str(e))

    if args.format == "json":
        out: Any = [r.to_dict() for r in reports]
        if args.graph:
            for d, r in zip(out, reports):
                d["graph"] = print_cut_graph(r)
        print(json.dumps(out if len(out) > 1 else out[0], indent=2))
    else:
        for k, report in enumerate(reports):
            if len(reports) > 1:
                print(f"=== graph {k} of {len(reports)} ===")
            print(report.explain())
            if args.graph:
                print("\n" + print_cut_graph(report))
    target = args.svg or args.png
    if target:
        main_report = max(reports, key=lambda r: len(r.attention_layers))
        try:
            written = draw_cut(main_report, target, title=args.factory)
            print(f"picture of the cut: {written}", file=sys.stderr)
        except PictureUnavailable as e:
            print(f"no picture: {e}; the text above says the same", file=sys.stderr)
            return 0
    return 0
