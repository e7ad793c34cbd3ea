"""How a compiled graph is saved: the package's form (``compile_graph.BoxedGraph``: Inductor's
``CompiledFxGraph`` pickled as its cache bundles one) against torch's own
``torch._inductor.standalone_compile(...).save(format="binary")``, on one decoder-shaped aten graph.

Per format: the artifact's size, and the warm start of a fresh process that loads the
artifact and runs it once (median of ``--runs`` processes), with the same Inductor cache folder
(a restart on the same machine). The outputs of both loads are checked against eager.

    python benchmarks/artifact_format.py --out results/x.json [--device cuda] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def decoder(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor]:
    """A few pre-norm decoder layers (attention through SDPA, gated MLP): what a region holds."""
    heads = 4
    for wqkv, wo, wgu, wd in zip(*[iter(weights)] * 4):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        q, k, v = (h @ wqkv).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(0, 1) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(0, 1).flatten(1) @ wo
        g, u = (torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ wgu).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(g) * u) @ wd
    return (x,)


def inputs(device: str, layers: int = 4, tokens: int = 64, dim: int = 256) -> list[torch.Tensor]:
    torch.manual_seed(0)
    weights = []
    for _ in range(layers):
        weights += [torch.randn(dim, 3 * dim), torch.randn(dim, dim), torch.randn(dim, 4 * dim),
                    torch.randn(2 * dim, dim)]
    return [t.to(device) * 0.05 for t in [torch.randn(tokens, dim), *weights]]


def save_both(folder: Path, device: str) -> dict:
    """Compile the graph both ways and save each artifact; their sizes. (Compile times are not
    compared: the second compile hits the first one's kernels in Inductor's cache.)"""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fx_fastprefill import torch_seams
    from fx_fastprefill.compilation import compile_graph
    args = inputs(device)
    decompositions = torch_seams.inductor_decompositions()
    torch.save(args, folder / "inputs.pt")
    torch.save(decoder(*args)[0], folder / "expected.pt")
    record = {}
    gm = make_fx(decoder, decompositions, tracing_mode="fake")(*args)  # aten, as AOTAutograd hands it over
    with compile_graph.lowering(small_contractions=False, saving=True):
        boxed = compile_graph.compile_boxed(gm, "inductor")
    (folder / "package.bin").write_bytes(pickle.dumps(boxed))
    record["package_bytes"] = (folder / "package.bin").stat().st_size
    gm = make_fx(decoder, decompositions)(*args)
    artifact = torch._inductor.standalone_compile(gm, args, dynamic_shapes="from_example_inputs")
    artifact.save(path=str(folder / "standalone.bin"), format="binary")
    record["standalone_bytes"] = (folder / "standalone.bin").stat().st_size
    return record


def load_and_run(folder: Path, form: str) -> float:
    """In this process: load one artifact, run it once; seconds from start to the output."""
    start = time.perf_counter()
    args = torch.load(folder / "inputs.pt")
    if form == "package":
        fn = pickle.loads((folder / "package.bin").read_bytes())
        out = fn(list(args))[0]
    else:
        fn = torch._inductor.CompiledArtifact.load(path=str(folder / "standalone.bin"), format="binary")
        out = fn(*args)[0]
    if out.is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.testing.assert_close(out, torch.load(folder / "expected.pt"), rtol=2e-3, atol=2e-3)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--load", nargs=2, metavar=("FOLDER", "FORM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        print(json.dumps({"load_s": load_and_run(Path(args.load[0]), args.load[1])}))
        return
    folder = Path(tempfile.mkdtemp(prefix="artifact_format_"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    record = {"device": args.device, "torch": torch.__version__, "runs": args.runs,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              **save_both(folder, args.device)}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for form in ("package", "standalone"):
        times = []
        for _ in range(args.runs):
            done = subprocess.run([sys.executable, __file__, "--load", str(folder), form], env=env,
                                  capture_output=True, text=True, check=True)
            times.append(json.loads(done.stdout.strip().splitlines()[-1])["load_s"])
        record[f"{form}_warm_load_and_run_s"] = statistics.median(times)
        record[f"{form}_warm_load_and_run_s_runs"] = times
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
