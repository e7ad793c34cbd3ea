"""Piecewise CUDA graphs: step padding and the record/replay logic (CPU, with a stand-in for a graph
that reruns the piece into its recorded outputs), and real replays against the model without
graphs (GPU)."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch

import fx_fastprefill
from fx_fastprefill import SeqChunk
from fx_fastprefill import fallbacks
from fx_fastprefill.compilation.backend import FastPrefillBackend
from fx_fastprefill.compilation import cudagraphs
from fx_fastprefill.compilation.cudagraphs import StagingBuffers
from fx_fastprefill.ops.schema import is_package_op
from fx_fastprefill.passes.split_pieces import EAGER, GRAPH, VIEWS, runs_eagerly, split_pieces
from fx_fastprefill.runtime.batch import default_token_pad_sizes
from tests.helpers import STEPS, RerunRecorder, run_steps, small_model

def test_default_sizes_pad_little():
    sizes = default_token_pad_sizes(8192)
    assert sizes[:3] == [2, 4, 8] and sizes[-1] == 8192 and 512 in sizes and 1024 in sizes
    assert all(b - a <= 512 for a, b in zip(sizes, sizes[1:]))


@functools.lru_cache(maxsize=None)
def reference() -> list[torch.Tensor]:
    """The model's logits without the cut, padding or graphs."""
    torch._dynamo.reset()
    return run_steps(fx_fastprefill.backend(compiler="eager", fast_prefill=False))[1]


def test_padded_steps_give_the_same_logits():
    # Padding rows belong to a request of their own: the real rows' logits must not change.
    runner, padded = run_steps(fx_fastprefill.backend(compiler="eager"), token_pad_sizes=[16, 48, 64])
    for p, q in zip(reference(), padded):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)
    assert runner.report.cut


def test_recorded_pieces_replay_the_model():
    """Staging of eager-op outputs, the non-static region inputs and the per-size keys: a replay
    must compute what the model computes without graphs, step after step (with Inductor's pieces:
    test_layers_of_one_kind_compile_one_piece)."""
    plain = reference()
    torch._dynamo.reset()
    recorder = RerunRecorder()
    backend = FastPrefillBackend(compiler="eager", cudagraphs=True)
    runner, replayed = run_steps(backend, capture=True, token_pad_sizes=[16, 48, 64], graph_recorder=recorder)
    for p, q in zip(plain, replayed):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)
    assert runner.report.cut and runner.report.cudagraphs and recorder.replays > 0
    assert backend.fallbacks[fallbacks.CUDAGRAPH_WARMUP] > 0  # each new size's first call is counted


def test_pieces_split_at_the_package_ops_and_gathers():
    from examples.dense import tiny
    torch.manual_seed(0)
    runner = fx_fastprefill.Runner(tiny(), backend=fx_fastprefill.backend(compiler="eager"), max_num_tokens=32)
    runner.step([SeqChunk(0, list(range(1, 12)), 1), SeqChunk(1, list(range(3, 9)), 1)])
    gm = runner.report.graph
    split, infos = split_pieces(gm)
    calls = lambda module: [n for n in module.graph.nodes if n.op == "call_function"]  # noqa: E731
    eager = [n for n in calls(gm) if runs_eagerly(n)]
    assert any(is_package_op(n) for n in eager) and any(not is_package_op(n) for n in eager)  # attention and gathers
    # Every node runs once, in a piece of the right kind; eager pieces hold nothing else.
    by_kind = {kind: [op for i in infos if i.kind == kind for op in calls(getattr(split, i.name))]
               for kind in (EAGER, GRAPH, VIEWS)}
    assert [n.target for n in by_kind[EAGER]] == [n.target for n in eager]
    assert sum(map(len, by_kind.values())) == len(calls(gm))
    assert [i.kind for i in infos].count(EAGER) > 1 and all(
        a.kind != b.kind or a.kind != EAGER for a, b in zip(infos, infos[1:]))
    # Identical layers give pieces of one signature (compiled once).
    signatures = [cudagraphs.piece_signature(getattr(split, i.name), []) for i in infos if i.kind == GRAPH]
    assert len(set(signatures)) < len(signatures)
    # The split graph computes what the graph computes.
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in split.graph.nodes if n.op == "placeholder"] == [n.name for n in inputs]


@pytest.mark.slow
def test_layers_of_one_kind_compile_one_piece(monkeypatch):
    """The per-layer input's slice of each layer (``select(per_layer, 1, i)``) moves out of the
    pieces, so the pieces of layers of one kind are equal and compile once; replays of the shared
    compiled pieces still give the model's logits (and each Inductor piece checks that its inputs
    have the sizes and strides it was compiled for)."""
    from examples.gemma3n import Config, Gemma3nLike
    compiled, pieces, regions = [], [], []
    compile_boxed, signature = cudagraphs.compile_boxed, cudagraphs.piece_signature
    monkeypatch.setattr(cudagraphs, "compile_boxed", lambda *a: compiled.append(a) or compile_boxed(*a))
    monkeypatch.setattr(cudagraphs, "piece_signature", lambda *a: pieces.append(signature(*a)) or pieces[-1])
    region_init = cudagraphs.PiecewiseRegion.__init__
    monkeypatch.setattr(cudagraphs.PiecewiseRegion, "__init__",
                        lambda self, *a, **k: regions.append(self) or region_init(self, *a, **k))

    def layered(backend, recorder=None):
        torch.manual_seed(7)
        runner = fx_fastprefill.Runner(Gemma3nLike(Config(n_layers=8, pattern=4, num_kv_shared_layers=2)),
                                       backend=backend, max_num_tokens=64, max_model_len=96,
                                       token_pad_sizes=[16, 48, 64], graph_recorder=recorder)
        if backend.cudagraphs:
            runner.capture(progress=False)
        return runner, [runner.step(chunks) for chunks in STEPS]

    torch._dynamo.reset()
    _, expected = layered(fx_fastprefill.backend(compiler="eager", fast_prefill=False))
    torch._dynamo.reset()
    recorder = RerunRecorder()
    runner, replayed = layered(FastPrefillBackend(compiler="inductor", cudagraphs=True), recorder)
    assert runner.report.cut and runner.report.cudagraphs and recorder.replays > 0
    assert runner.backend.fallbacks[fallbacks.CUDAGRAPH_WARMUP] > 0  # each new size's first call is counted
    # Layers 3 and 7 full, the others sliding, 6 and 7 reading earlier K/V: the pieces from sliding
    # layer 0 to 1, 1 to 2 and 4 to 5 are equal.
    assert len(compiled) == len(set(pieces)) <= len(pieces) - 2, (len(compiled), len(pieces))
    # The program cache pickles the regions together: a shared compiled piece is stored and loaded once.
    loaded = pickle.loads(pickle.dumps(regions))
    assert len({id(p.fn) for r in loaded for p in r.pieces}) == len(compiled)
    for e, r in zip(expected, replayed):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-5)


def test_piece_signatures_differ_by_what_the_code_depends_on_not_by_names():
    def piece(scale=2.0, dtype=torch.float32, name="mul"):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        x.meta["val"] = torch.empty(4, 8, dtype=dtype)
        graph.output(graph.create_node("call_function", torch.ops.aten.mul.Tensor, (x, scale), name=name))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    base = cudagraphs.piece_signature(piece(), [])
    assert cudagraphs.piece_signature(piece(name="mul_17"), []) == base
    assert cudagraphs.piece_signature(piece(scale=3.0), []) != base
    assert cudagraphs.piece_signature(piece(dtype=torch.bfloat16), []) != base
    assert cudagraphs.piece_signature(piece(), [0]) != base
    # Tensors among the arguments count by identity: printed, these two would look the same.
    middle = torch.zeros(2000)
    middle[1000] = 1.0
    assert cudagraphs.piece_signature(piece(scale=torch.zeros(2000)), []) != cudagraphs.piece_signature(
        piece(scale=middle), [])


def test_bad_pad_sizes_and_seq_ids():
    with pytest.raises(ValueError, match="token_pad_sizes must be ints in"):
        fx_fastprefill.Runner(small_model(), backend=fx_fastprefill.backend(compiler="eager"), max_num_tokens=8,
                              token_pad_sizes=[4, 16])
    with pytest.raises(ValueError, match="token_pad_sizes needs a compiled model"):
        fx_fastprefill.Runner(small_model(), max_num_tokens=8, token_pad_sizes=[4])
    runner = fx_fastprefill.Runner(small_model(), max_num_tokens=8)
    with pytest.raises(ValueError, match="seq_id must be a non-negative int"):
        runner.step([SeqChunk(-1, [1, 2])])



def test_cudagraphs_with_the_eager_compiler_and_no_recorder_fall_back_with_a_reason():
    backend = fx_fastprefill.backend(cudagraphs=True, compiler="eager")
    runner = fx_fastprefill.Runner(small_model(), backend=backend, max_num_tokens=16, max_model_len=32,
                                   token_pad_sizes=[4, 16])
    runner.step([SeqChunk(0, [1, 2, 3])])
    assert backend.fallbacks[fallbacks.CUDAGRAPHS_NEED_INDUCTOR] == 1 and not runner.report.cudagraphs
    assert runner.whole_step_graphs is None  # no recorder on the CPU: no whole-step graphs either


def test_cudagraphs_on_the_cpu_fall_back_with_a_reason():
    from examples.dense import Config, Dense
    torch.manual_seed(0)
    backend = fx_fastprefill.backend(cudagraphs=True)
    runner = fx_fastprefill.Runner(Dense(Config(n_layers=2)), backend=backend, max_num_tokens=16, max_model_len=32,
                                   token_pad_sizes=[4, 16])
    runner.step([SeqChunk(0, [1, 2, 3])])
    assert backend.fallbacks[fallbacks.CUDAGRAPHS_NOT_CUDA] == 1 and not runner.report.cudagraphs
    assert runner.report.fallbacks[fallbacks.CUDAGRAPHS_NOT_CUDA] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudagraph_replays_match_the_model_without_graphs():
    _, reference = run_steps(fx_fastprefill.backend(), "cuda", torch.bfloat16)
    backend = fx_fastprefill.backend(cudagraphs=True)
    runner, replayed = run_steps(backend, "cuda", torch.bfloat16, capture=True, token_pad_sizes=[2, 4, 8, 16, 32, 64])
    assert runner.report.cudagraphs and runner.report.cut
    assert backend.fallbacks[fallbacks.CUDAGRAPH_RECORD_FAILED] == 0, dict(backend.fallbacks)
    # Every step after capture() replays: no size is first seen while serving.
    warmups = backend.fallbacks[fallbacks.CUDAGRAPH_WARMUP]
    later = [runner.step(chunks) for chunks in [[SeqChunk(10, list(range(1, 30)), 1)], [SeqChunk(11, [3, 4, 5])]]]
    assert all(torch.isfinite(r).all() for r in later)
    for r, g in zip(reference, replayed):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)
    assert backend.fallbacks[fallbacks.CUDAGRAPH_WARMUP] - warmups <= 2  # at most the pure-decode full-rows size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.bool, torch.int64])
def test_a_non_owning_view_reads_the_memory_and_does_not_keep_it(dtype):
    base = torch.randn(64, 48, device="cuda").to(dtype)
    view = base[3:, 1::2].t()  # an offset, a stride and a transpose
    alias = cudagraphs.non_owning(view)
    assert (alias.shape, alias.stride(), alias.dtype, alias.device) == (view.shape, view.stride(), dtype, view.device)
    assert alias.data_ptr() == view.data_ptr() and torch.equal(alias, view)
    base.view(-1)[:] = base.view(-1).flip(0)  # the alias sees writes to the memory
    assert torch.equal(alias, view)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    del base, view
    assert torch.cuda.memory_allocated() < before  # the alias did not keep the storage
    assert cudagraphs.non_owning(torch.empty(0, 3, device="cuda")).shape == (0, 3)


def test_staging_keeps_strides_and_grows_without_moving_old_views():
    staging = StagingBuffers()
    strided = torch.randn(4, 7, 8)[:, 2]  # [4, 8] with stride (56, 1): what a compiled reader expects
    view = staging.view(0, strided)
    assert view.shape == strided.shape and view.stride() == strided.stride()
    view.copy_(strided)
    torch.testing.assert_close(view, strided)
    assert staging.owns(view[1:]) and not staging.owns(strided)
    small = staging.view(0, torch.zeros(2, 8))
    assert small.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()  # fits: same buffer
    big = staging.view(0, torch.zeros(64, 64))
    assert big.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    torch.testing.assert_close(view, strided)  # the old view keeps its buffer and contents


def test_keyed_graph_lifecycle():
    """Warm up, record, replay per key; a failed key runs without graphs for good; each call
    without a graph counted with its reason."""
    from collections import Counter

    from fx_fastprefill.compilation import graph_lifecycle as lifecycle
    counted = Counter()
    keys = lifecycle.KeyedGraphLifecycle(lambda reason: counted.update([reason]), "warm-up", "failed")
    assert [keys.action(1), keys.action(1)] == [lifecycle.WARM_UP, lifecycle.RECORD]
    keys.recorded(1)
    assert keys.action(1) == lifecycle.REPLAY and keys.settled(1)
    assert [keys.action(2), keys.action(2)] == [lifecycle.WARM_UP, lifecycle.RECORD]
    keys.failed(2)
    assert keys.action(2) == lifecycle.NO_GRAPH and keys.settled(2) and keys.failures == 1
    assert counted == {"warm-up": 2, "failed": 2}
    keys.clear()
    assert keys.action(1) == lifecycle.WARM_UP


def test_the_piece_split_is_a_timed_and_dumped_pass(tmp_path, monkeypatch):
    """With CUDA graphs (here the stand-in recorder), the regions are split into pieces by the
    pipeline's ``pieces`` pass: timed in the report and written with FX_FASTPREFILL_DUMP_GRAPHS."""
    monkeypatch.setenv("FX_FASTPREFILL_DUMP_GRAPHS", str(tmp_path))
    torch._dynamo.reset()
    backend = FastPrefillBackend(compiler="eager", cudagraphs=True)
    runner, _ = run_steps(backend, token_pad_sizes=[16, 32, 64], graph_recorder=RerunRecorder())
    assert runner.report.cut and "pieces" in runner.report.pass_seconds
    [dump] = tmp_path.glob("*_pieces.txt")
    text = dump.read_text()
    assert "# full" in text and "# reduced" in text and "piece_" in text


@pytest.mark.parametrize("fast_prefill", [True, False])
def test_after_capture_no_step_warms_up_with_or_without_the_pass(fast_prefill):
    """capture() records every size a step can take: for the cut program each T and each R, for
    the program compiled unchanged (the benchmarks' baseline, one region keyed by (T, R)) every
    pair. No step after it runs a region without graphs."""
    backend = FastPrefillBackend(compiler="eager", cudagraphs=True, fast_prefill=fast_prefill)
    runner, _ = run_steps(backend, capture=True, token_pad_sizes=[16, 32, 64], graph_recorder=RerunRecorder())
    assert runner.report.cut == fast_prefill and runner.report.cudagraphs
    warm_ups = backend.fallbacks[fallbacks.CUDAGRAPH_WARMUP]
    runner.step([SeqChunk(20, list(range(1, 40)), 1), SeqChunk(21, [3, 4, 5], 3)])  # (T, R) = (64, 4)
    runner.step([SeqChunk(22, list(range(1, 9)), 8)])                                 # (16, 8)
    assert backend.fallbacks[fallbacks.CUDAGRAPH_WARMUP] == warm_ups, dict(backend.fallbacks)


def test_capture_asks_the_program_how_it_keys_its_graphs_not_the_shared_backends_latest_report():
    """One backend compiles a cut model, then a model it leaves unchanged (its latest report): the
    cut model's capture still records its T and R apart, and no step of it warms up afterwards."""
    from tests.helpers import Variant
    backend = FastPrefillBackend(compiler="eager", cudagraphs=True)
    cut = fx_fastprefill.Runner(small_model(), backend=backend, max_num_tokens=64, max_model_len=96,
                                token_pad_sizes=[16, 32, 64], graph_recorder=RerunRecorder())
    cut.step([SeqChunk(0, list(range(1, 9)), 1)])
    cut.free(0)
    other = fx_fastprefill.Runner(Variant("row_mixing_after_last_layer"), backend=backend, max_num_tokens=16,
                                  max_model_len=32, token_pad_sizes=[16], graph_recorder=RerunRecorder())
    other.step([SeqChunk(0, [1, 2, 3])])
    assert backend.reports[-1].cudagraphs and not backend.reports[-1].cut  # the latest report is the other's
    recorded = []
    record_size = cut._record_size
    cut._record_size = lambda t, r: recorded.append((t, r)) or record_size(t, r)
    cut.capture(progress=False)
    assert recorded == cut._capture_sizes([16, 32, 64], keyed_together=False)  # T and R apart, not every pair
    warm_ups = backend.fallbacks[fallbacks.CUDAGRAPH_WARMUP]
    cut.step([SeqChunk(20, list(range(1, 40)), 1), SeqChunk(21, [3, 4, 5], 3)])
    cut.step([SeqChunk(22, list(range(1, 9)), 8)])
    assert backend.fallbacks[fallbacks.CUDAGRAPH_WARMUP] == warm_ups, dict(backend.fallbacks)
