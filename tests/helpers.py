"""Helpers shared by the tests: random prompts, tiny traced graphs, where a product runs, a small flat
model run through fixed steps, a CPU stand-in for CUDA graphs, runners with whole-step graphs, and a
two-layer model whose ending decides whether it can be cut."""

from __future__ import annotations

import contextlib
import random

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

import fx_fastprefill
from fx_fastprefill import SeqChunk
from fx_fastprefill.compilation.backend import FastPrefillBackend
from fx_fastprefill.passes.split_regions import assign_regions
from examples.blocks import Attention
from examples.gemma3n import Config, Gemma3nLike

aten = torch.ops.aten


def compiling_in(fake_mode):
    """As AOTAutograd compiles the graph a backend was given: inside a tracing context of the
    inputs' fake mode, whose shape environment Inductor's FX graph cache keys and guards with
    (without one, Inductor compiles uncached)."""
    from torch._guards import TracingContext, tracing
    return tracing(TracingContext(fake_mode)) if fake_mode is not None else contextlib.nullcontext()


def fake_mode_of(gm: GraphModule):
    """The fake mode a traced graph's placeholder values were made in."""
    from torch._guards import detect_fake_mode

    from fx_fastprefill.compilation.compile_graph import example_inputs
    return detect_fake_mode(example_inputs(gm))


def random_prompts(n, lo, hi, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def trace(fn, *shapes, dtypes=None) -> GraphModule:
    """An aten graph of ``fn`` on random inputs of ``shapes``, every size symbolic (like the
    backend's graphs); integer inputs where ``dtypes`` says so."""
    dtypes = dtypes or [torch.float32] * len(shapes)
    inputs = [torch.randint(0, 3, s) if d in (torch.int64, torch.int32) else torch.randn(s, dtype=d)
              for s, d in zip(shapes, dtypes)]
    return make_fx(fn, tracing_mode="symbolic")(*inputs)


def first(gm: GraphModule, target) -> Node:
    return next(n for n in gm.graph.nodes if n.target == target)


def rows_of(gm: GraphModule, position: int = 0, dim: int = 0):
    """The size symbol of dim ``dim`` of input ``position``: the token count of a test graph."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return inputs[position].meta["val"].shape[dim].node.expr


def products_of(report, weight_name):
    """(region, rows of the weight read) of every mm whose weight operand comes from ``weight_name``."""
    gm = report.graph
    regions = assign_regions(gm)
    names = dict(report.placeholder_names)
    found = []
    for node in gm.graph.nodes:
        if node.target is not aten.mm.default:
            continue
        weight, rows = node.args[1], None
        while weight.op == "call_function":
            if weight.target is aten.slice.Tensor:
                rows = (weight.args[2], weight.args[3])
            weight = weight.args[0]
        if names.get(weight) == weight_name:
            found.append((regions[node], rows))
    return found


def aten_graph(fn, *inputs, dynamic: dict[int, list[int]] | None = None) -> GraphModule:
    """The post-AOT aten graph the backend's passes see for ``fn(*inputs)``: the dims in ``dynamic``
    ({input position: dims}) are symbolic, every other size is static (weights are)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    captured = []

    class Captured(Exception):
        pass

    def capture(gm, example_inputs):
        def keep(aten_gm, aten_inputs):
            captured.append(aten_gm)
            raise Captured  # nothing runs: the graph may call ops that need a step
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, inference_compiler=keep)

    for position, dims in (dynamic or {}).items():
        for dim in dims:
            torch._dynamo.mark_dynamic(inputs[position], dim)
    torch._dynamo.reset()
    try:
        with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False):
            torch.compile(fn, backend=capture, dynamic=False, fullgraph=True)(*inputs)
    except Exception:
        if not captured:
            raise
    return captured[-1]


STEPS = [
    [SeqChunk(0, list(range(1, 15)), 1), SeqChunk(1, list(range(5, 25)), 0)],
    [SeqChunk(0, [7]), SeqChunk(1, list(range(25, 31)), 3), SeqChunk(2, list(range(40, 52)), 2)],
    [SeqChunk(0, [8, 9, 10], 3), SeqChunk(1, [11], 1), SeqChunk(2, list(range(60, 63)), 1)],
    [SeqChunk(0, [12]), SeqChunk(1, [13]), SeqChunk(2, [14])],
    [SeqChunk(0, [15])],
]


def small_model():
    """A small flat Gemma-3n-like model: 5 layers, 2 sharing K/V, a window of 5."""
    torch.manual_seed(5)
    return Gemma3nLike(Config(n_layers=5, pattern=3, num_kv_shared_layers=2, sliding_window=5))


def run_steps(backend, device="cpu", dtype=torch.float32, capture=False, **options):
    """The STEPS through a Runner of the small model; the runner and each step's logits."""
    runner = fx_fastprefill.Runner(small_model(), backend=backend, max_num_tokens=64, max_model_len=96, device=device,
                                   dtype=dtype, **options)
    if capture:
        runner.capture(progress=False)
    return runner, [runner.step(chunks) for chunks in STEPS]


class RerunGraph:
    """A CUDA graph's contract on the CPU: replay reads the recorded input tensors and writes the
    recorded output tensors, whatever the caller holds."""

    def __init__(self, fn, args, outputs):
        self.fn, self.args, self.outputs = fn, list(args), outputs
        self.replays = 0

    def replay(self):
        self.replays += 1
        for out, new in zip(self.outputs, self.fn(list(self.args))):
            if isinstance(out, torch.Tensor):
                out.copy_(new)


class RerunRecorder:
    """Records a piece as a RerunGraph (the Runner's ``graph_recorder``, in place of CUDA graphs)."""

    def __init__(self):
        self.graphs = []

    def new_pool(self):
        return None

    def capture(self, fn, args, pool):
        outputs = fn(list(args))
        self.graphs.append(RerunGraph(fn, args, outputs))
        return self.graphs[-1], outputs

    @staticmethod
    def alias(t):
        return t

    @property
    def replays(self):
        return sum(g.replays for g in self.graphs)


# --- whole-step graphs (tests/test_whole_step_graphs.py, tests/test_step_plan.py) ---

PROMPTS = random_prompts(3, 3, 20, 512, seed=4)  # longer than the model's window of 5
PAD_SIZES = [2, 4, 8, 16, 64]


def make_runner(backend, **options) -> fx_fastprefill.Runner:
    return fx_fastprefill.Runner(small_model(), backend=backend, max_num_tokens=64, max_model_len=96, max_num_seqs=4,
                                 **options)


def plain_runner() -> fx_fastprefill.Runner:
    """The same model, eager: no compile, no pass, no graphs, no padding."""
    return make_runner(None)


def graphed_runner(**options):
    recorder = RerunRecorder()
    backend = FastPrefillBackend(compiler="eager", cudagraphs=True)
    return make_runner(backend, token_pad_sizes=PAD_SIZES, graph_recorder=recorder, **options), backend, recorder


# --- a model cut or not by its ending (tests/test_not_cut.py) ---

class Variant(nn.Module):
    """One attention layer that computes its own K/V, one that shares it; ``ending`` picks how
    the logits are formed."""

    def __init__(self, ending: str):
        super().__init__()
        self.vocab_size, self.ending = 64, ending
        self.embed = nn.Embedding(64, 32)
        self.a = Attention("a", 32, 4, 2, 8)
        self.b = Attention("b", 32, 4, 2, 8, kv_source="a")
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids, positions, logits_indices):
        h = self.embed(input_ids)
        h = h + self.a(h, positions)
        h = h + self.b(h, positions)
        if self.ending == "all_rows":
            return self.head(h)
        if self.ending == "two_token_counts":
            return self.head(h[logits_indices] + torch.cat([h, h])[logits_indices])
        if self.ending == "flattened_output":
            return self.head(h[logits_indices]).reshape(-1)
        if self.ending == "row_mixing_after_last_layer":
            h = h + 0.1 * h.cumsum(0)
        return self.head(h[logits_indices])
