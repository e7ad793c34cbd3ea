"""The compiled program in torch's AOTAutograd cache (compilation/program_cache.py).

- Two processes: the cold one compiles and saves; the warm one, on an empty folder given the
  cold one's cache artifacts and other weights, hits the AOTAutograd cache, compiles no Inductor
  graph, is cut, and equals the model without the pass. (Subprocesses: what is tested is a restart.)
- Another option misses the program compiled under the first (in one process).
- In one process: a program loaded from the cache (gate, piecewise regions with the test's
  stand-in recorder, eager pieces) computes what the freshly compiled one does.
- The key: a changed source, option or pass list is a different tag; a pass without source cannot
  be keyed and compiles uncached, counted.
- Tensor parallel: one rank warm, one cold; both finish, cut, with the same plan.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import fx_fastprefill
from fx_fastprefill import SeqChunk, fallbacks
from fx_fastprefill.compilation import damaged_files, program_cache
from fx_fastprefill.compilation.backend import FastPrefillBackend
from fx_fastprefill.passes.pipeline import PIPELINE
from tests.children import run_child
from tests.distributed import run_ranks
from tests.helpers import compiling_in, fake_mode_of

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.program_cache


def _child(cache_dir: Path, *args: str) -> dict:
    return run_child("tests.program_cache_child", cache_dir, *args)


@pytest.fixture(scope="module")
def cold_cache(tmp_path_factory) -> tuple[Path, Path, dict]:
    """One cold process's cache folder, its caches as torch's cache artifacts, and what it did."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("cold")
    cold = _child(root / "cache", "--save-artifacts", str(root / "artifacts.bin"))
    return root / "cache", root / "artifacts.bin", cold


@pytest.mark.slow
def test_a_warm_process_loads_the_program_and_compiles_nothing(tmp_path, cold_cache):
    cache, artifacts, cold = cold_cache
    # The caches shipped as torch's cache artifacts into an empty folder (a restart on another
    # machine), with other weights (the program reads the parameters). The same folder restarted
    # is the warm rank of the tensor-parallel test below and the precompiled restarts.
    warm = _child(tmp_path / "other_machine", "--load-artifacts", str(artifacts), "--weights-seed", "3")
    assert cold["aot"].get("autograd_cache_saved", 0) >= 1 and cold["inductor_graphs"] > 0, cold
    assert cold["cut"] and not cold["from_cache"], cold
    assert warm["aot"].get("autograd_cache_hit", 0) == 1 and warm["inductor_graphs"] == 0, warm
    assert warm["cut"] and warm["from_cache"] and warm["reduced_layers"] == cold["reduced_layers"], warm
    assert warm["fallbacks"] == {}, warm
    for run in (cold, warm):
        assert run["max_abs_err"] <= 1e-5 * run["scale"], run  # fp32 against the model without the pass


@pytest.mark.slow
def test_a_truncated_output_code_file_is_deleted_and_made_again(tmp_path, cold_cache):
    """Issue 42: every compiled graph's code file (``<key>.py``) in the cache cut short, as a full
    disk or a killed writer leaves it. Before, each failed to import in every later process, the
    cut regions failed to compile and the graph ran uncut. Now each is deleted and written again
    from the compiled graph Inductor kept: the program loads from the cache, cut, counted once a file."""
    cache, _, cold = cold_cache
    shutil.copytree(cache, tmp_path / "cache")
    code_files = [p for p in (tmp_path / "cache").glob("??/c*.py")]
    assert code_files
    for path in code_files:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    warm = _child(tmp_path / "cache")
    assert warm["cut"] and warm["from_cache"] and warm["reduced_layers"] == cold["reduced_layers"], warm
    assert warm["aot"].get("autograd_cache_hit", 0) == 1 and warm["inductor_graphs"] == 0, warm
    assert warm["fallbacks"] == {fallbacks.COMPILED_FILE_DAMAGED: len(code_files)}, warm
    assert warm["max_abs_err"] <= 1e-5 * warm["scale"], warm
    for path in code_files:
        assert path.read_bytes().endswith(b"\n") and compile(path.read_text(), str(path), "exec")


def test_another_option_misses_the_program_it_would_otherwise_be_served(tmp_path, monkeypatch):
    """AOTAutograd's own key covers the Dynamo graph, not the compiler: without the package's tag
    a backend with another option would be served the program compiled under the first one."""
    from torch._dynamo.utils import counters

    from examples import hf_gemma4
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = hf_gemma4.smallest()
    ids = torch.randint(1, model.config.vocab_size, (2, 11))

    def compile_and_run(**options) -> tuple[FastPrefillBackend, dict]:
        torch._dynamo.reset()
        counters.clear()
        backend = fx_fastprefill.backend(compiler="eager", **options)
        with torch.no_grad():
            logits = torch.compile(model, backend=backend, dynamic=False)(ids, logits_to_keep=1).logits
            torch.testing.assert_close(logits, model(ids, logits_to_keep=1).logits)
        return backend, dict(counters["aot_autograd"])

    first, first_aot = compile_and_run()
    other, other_aot = compile_and_run(narrow_slices=False)
    again, again_aot = compile_and_run()
    assert first_aot.get("autograd_cache_saved") == 1 and not first.reports[-1].from_cache, first_aot
    assert not other_aot.get("autograd_cache_hit") and other_aot.get("autograd_cache_saved") == 1, other_aot
    assert other.reports[-1].cut and not other.reports[-1].from_cache
    assert again_aot.get("autograd_cache_hit") == 1 and again.reports[-1].from_cache, again_aot


def _runner_steps(backend, **options):
    from tests.helpers import run_steps as run
    return run(backend, **options)


def test_a_loaded_program_computes_what_the_compiled_one_does(tmp_path, monkeypatch):
    """Cut, gated, piecewise with the stand-in recorder: compiled, then (after a Dynamo reset) the
    same graph again from the cache, which must replay the same logits."""
    from tests.helpers import RerunRecorder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # empty: the first compile is one
    for options in (dict(compiler="eager"), dict(compiler="eager", cudagraphs=True)):
        recorder = RerunRecorder() if options.get("cudagraphs") else None
        torch._dynamo.reset()
        fresh_backend = FastPrefillBackend(**options)
        fresh_runner, fresh = _runner_steps(fresh_backend, capture=True, token_pad_sizes=[16, 48, 64],
                                            graph_recorder=recorder)
        assert fresh_runner.report.cut and not fresh_runner.report.from_cache
        torch._dynamo.reset()
        loaded_backend = FastPrefillBackend(**options)
        loaded_runner, loaded = _runner_steps(loaded_backend, capture=True, token_pad_sizes=[16, 48, 64],
                                              graph_recorder=recorder)
        report = loaded_runner.report
        assert report.cut and report.from_cache, options
        assert report.reduced_layers == fresh_runner.report.reduced_layers
        assert "loaded from the AOTAutograd cache" in report.summary()
        for a, b in zip(fresh, loaded):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        # Fallbacks of the loaded program are counted on the backend that loaded it, as they were.
        assert dict(loaded_backend.fallbacks) == dict(fresh_backend.fallbacks)
        if options.get("cudagraphs"):
            assert report.cudagraphs and recorder.replays > 0
            assert loaded_backend.fallbacks[fallbacks.CUDAGRAPH_WARMUP] > 0


def test_the_explain_command_always_runs_the_passes():
    from examples.dense import tiny
    from fx_fastprefill.explain import compile_and_report
    first = compile_and_report(tiny())
    again = compile_and_report(tiny())
    assert not any(r.from_cache for r in first + again) and all(r.graph is not None for r in again)


def _copy_package(to: Path) -> Path:
    for name in ("fx_fastprefill", "passes"):
        shutil.copytree(ROOT / name, to / name, ignore=shutil.ignore_patterns("__pycache__"))
    return to


def test_a_changed_source_changes_the_key(tmp_path):
    copy = _copy_package(tmp_path)
    roots = (copy / "fx_fastprefill", copy / "passes")
    before = program_cache.digest_sources(roots)
    assert program_cache.digest_sources(roots) == before
    with open(copy / "passes" / "cut_graph.py", "a") as f:
        f.write("\n# a changed line\n")
    assert program_cache.digest_sources(roots) != before
    (copy / "fx_fastprefill" / "new_module.py").write_text("X = 1\n")
    assert len({before, program_cache.digest_sources(roots)}) == 2


def test_regions_are_keyed_by_the_package_sources_and_compiled_under_the_users_tag(tmp_path, monkeypatch):
    """A region's Inductor graph is keyed with the package's sources (not its cache tag, which
    Inductor would also key the kernels' autotuning with): another digest is an FX graph cache
    miss, the same digest a hit; a user's custom post-grad pass still runs and keys too."""
    from torch._dynamo.utils import counters
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from fx_fastprefill.compilation.compile_graph import inductor
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gm = make_fx(lambda x: (torch.relu(x) * 2,))(torch.randn(8))
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    example = [fake_mode.from_tensor(torch.randn(8))]  # as a region's inputs are
    tags = []

    class UsersPass(CustomGraphPass):
        def __call__(self, graph):
            tags.append(torch.compiler.config.cache_key_tag)

        def uuid(self):
            return "the user's pass"

    def compile_with(digest: str) -> str:
        monkeypatch.setattr(program_cache, "package_digest", lambda: digest)
        before = dict(counters["inductor"])
        with torch.compiler.config.patch(cache_key_tag="the program's tag"), \
                torch._inductor.config.patch(post_grad_custom_post_pass=UsersPass()), \
                program_cache.compiling_regions("a user's tag"), compiling_in(fake_mode):
            inductor(gm, example, ())
        return next(k for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")
                    if counters["inductor"][k] > before.get(k, 0))
    assert [compile_with(d) for d in ("one", "two", "one")] == ["fxgraph_cache_miss", "fxgraph_cache_miss",
                                                                 "fxgraph_cache_hit"]
    assert tags == ["a user's tag"] * 2  # the user's pass ran in each compile (not on the hit)


def test_options_and_passes_change_the_key():
    tags = {program_cache.cache_key_tag(dict(compiler=c, narrow_slices=n), PIPELINE)
            for c in ("eager", "inductor") for n in (True, False)}
    assert len(tags) == 4 and None not in tags
    assert program_cache.cache_key_tag({}, PIPELINE[:-1]) != program_cache.cache_key_tag({}, PIPELINE)
    assert fx_fastprefill.backend().cache_tag != fx_fastprefill.backend(prompt_len=4096).cache_tag
    assert fx_fastprefill.backend().cache_tag == fx_fastprefill.backend().cache_tag


def test_passes_the_source_does_not_pin_are_not_keyed():
    import functools

    def make(threshold):
        def pass_(ctx):
            return threshold
        return pass_

    def plain(ctx):
        return None

    class WithUuid:
        def __init__(self, version):
            self.version = version

        def __call__(self, ctx):
            return None

        def uuid(self):
            return f"with-uuid-{self.version}"

    for unpinned in (make(1), functools.partial(plain), WithUuid.__call__.__get__(WithUuid(1))):
        assert program_cache.cache_key_tag({}, [*PIPELINE, unpinned]) is None, unpinned
    assert program_cache.cache_key_tag({}, [*PIPELINE, plain]) is not None
    one, two = (program_cache.cache_key_tag({}, [*PIPELINE, WithUuid(v)]) for v in (1, 2))
    assert None not in (one, two) and one != two


def test_a_pass_without_source_compiles_uncached_and_counted():
    from examples.dense import tiny
    unreadable = eval("lambda ctx: None")  # no source file: inspect cannot read it
    backend = fx_fastprefill.backend(compiler="eager", passes=[*PIPELINE[:-1], unreadable, PIPELINE[-1]])
    assert backend.cache_tag is None
    runner = fx_fastprefill.Runner(tiny(), backend=backend, max_num_tokens=32)
    runner.step([SeqChunk(0, list(range(1, 12)), 1)])
    assert runner.report.cut and not runner.report.from_cache
    assert backend.fallbacks[fallbacks.NO_PROGRAM_CACHE] == 1


def _tp_rank(rank: int, cache_dirs: list[str]) -> dict:
    """The hand-sharded flat model on each rank, compiled with this rank's cache folder."""
    from examples.gemma3n import tiny
    from examples.tp import apply_tensor_parallel
    from torch._dynamo.utils import counters
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs[rank]
    torch.manual_seed(0)
    full = tiny()
    backend = fx_fastprefill.backend(compiler="eager")
    runner = fx_fastprefill.Runner(apply_tensor_parallel(full), backend=backend, max_num_tokens=64)
    prompts = [[(5 * i + j) % 500 + 1 for j in range(10 + 2 * i)] for i in range(2)]
    logits = runner.prefill(prompts)
    expected = fx_fastprefill.Runner(full, backend="eager", max_num_tokens=64).prefill(prompts)
    report = backend.reports[0]
    return dict(cut=report.cut, from_cache=report.from_cache, ranks=report.ranks, reason=report.reason,
                hits=counters["aot_autograd"]["autograd_cache_hit"],
                err=((logits - expected).abs().max() / expected.abs().max()).item())


@pytest.mark.slow
def test_tensor_parallel_ranks_with_one_cache_warm_and_one_cold(tmp_path):
    warm, cold, scratch = (str(tmp_path / name) for name in ("warm", "cold", "scratch"))
    run_ranks(_tp_rank, 2, [warm, scratch], timeout=timedelta(seconds=300))  # fills rank 0's folder
    per_rank = run_ranks(_tp_rank, 2, [warm, cold], timeout=timedelta(seconds=300))
    assert per_rank[0]["from_cache"] and per_rank[0]["hits"] >= 1, per_rank[0]
    assert not per_rank[1]["from_cache"] and per_rank[1]["hits"] == 0, per_rank[1]
    for result in per_rank:
        assert result["cut"], result["reason"]
        assert len(result["ranks"]) == 2 and len(set(result["ranks"])) == 1, result["ranks"]
        assert result["err"] <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_loaded_program_replays_real_cuda_graphs(tmp_path, monkeypatch):
    """On CUDA with Inductor and real piecewise CUDA graphs: the program loaded from the cache (its
    Triton kernels from the bundle) replays the logits the fresh one computed."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        backend = fx_fastprefill.backend(cudagraphs=True)
        runner, logits = _runner_steps(backend, device="cuda", dtype=torch.bfloat16, capture=True,
                                       token_pad_sizes=[16, 48, 64])
        runs.append((runner.report, logits, dict(backend.fallbacks)))
    (fresh, fresh_logits, _), (loaded, loaded_logits, fallbacks_loaded) = runs
    assert fresh.cut and not fresh.from_cache and loaded.cut and loaded.from_cache and loaded.cudagraphs
    assert fallbacks_loaded.get(fallbacks.CUDAGRAPH_RECORD_FAILED, 0) == 0, fallbacks_loaded
    for a, b in zip(fresh_logits, loaded_logits):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_a_program_that_does_not_pickle_says_which_part():
    """AOTAutograd logs a failed save and stores nothing: the message names the part to fix."""
    import pickle

    from fx_fastprefill.report.report import FastPrefillReport

    class Region:
        pass
    region = Region()
    region.kernels = [3, lambda: None]
    counted = fallbacks.FallbackCounter()
    code = program_cache.ProgramCode(region, FastPrefillReport(cut=True), [], "", counted.record)
    with pytest.raises(pickle.PicklingError, match=r"at \['program'\]\.kernels\[1\] \(function: <function "):
        code.prepare_for_serialization()
    assert counted == {fallbacks.PROGRAM_NOT_SAVED: 1} and code.program is region  # still runs in this process
    with pytest.raises(pickle.PicklingError):  # a second save of the same program: counted once
        code.prepare_for_serialization()
    assert counted == {fallbacks.PROGRAM_NOT_SAVED: 1}
    assert program_cache.unpicklable_part({"fine": [1, "two"]}) == ""

    class Launched:  # as Inductor's autotuner once its launchers are made
        def __getstate__(self):
            raise AssertionError("pickle should not be called after make_launchers()")
    assert "whose __getstate__ raised AssertionError" in program_cache.unpicklable_part({"k": [Launched()]})


def test_a_compiled_graph_is_saved_as_it_was_compiled(tmp_path, monkeypatch):
    """A graph's saved form is made when Inductor returns it: on an FX-graph-cache hit its bundle
    holds the very autotuners its code runs, which no longer pickle once they have run (the
    stand-in: an attribute that does not pickle, set after the compile)."""
    import pickle

    from torch.fx.experimental.proxy_tensor import make_fx

    from fx_fastprefill.compilation import compile_graph
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = torch.randn(5, 8), torch.randn(8, 3)
    outs = {}
    for saving in (True, False):
        gm = make_fx(lambda a, b: (torch.relu(a @ b) * 2,), tracing_mode="fake")(x, w)  # aten, fake values
        with compile_graph.lowering(small_contractions=False, saving=saving), compiling_in(fake_mode_of(gm)):
            boxed = compile_graph.compile_boxed(gm, "inductor")
        outs[saving] = boxed([x, w])[0]
        boxed.code.launched_kernel = lambda: None  # as a kernel that has run
        if saving:
            loaded = pickle.loads(pickle.dumps(boxed))
            torch.testing.assert_close(loaded([x, w])[0], torch.relu(x @ w) * 2)
        else:
            with pytest.raises(Exception):  # saved only when the program is: pickled now, it fails
                pickle.dumps(boxed)
    torch.testing.assert_close(outs[True], torch.relu(x @ w) * 2)


class _ConstantOnDevice:
    """A program's tensor constant as pickling a CUDA one works: its bytes copied to the CPU by a
    tensor op (under a FakeTensorMode the copy is fake and its bytes cannot be read)."""

    def __init__(self, values: list[int]):
        self.values = torch.tensor(values, dtype=torch.uint8)

    def __reduce__(self):
        return _ConstantOnDevice, (self.values.to("cpu", copy=True).tolist(),)


class _ProgramWithConstants:
    def __init__(self):
        self.constant, self.on_device = torch.tensor([0.95, 2.0]), _ConstantOnDevice([1, 2, 3, 4])


def test_a_program_is_saved_and_loaded_with_real_tensors_under_aots_fake_mode():
    """AOTAutograd saves and loads the program inside its FakeTensorMode: Gemma 3n's CUDA tensor
    constant failed to pickle there (seen on the GPU), and a constant unpickled there comes back fake."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from fx_fastprefill.report.report import FastPrefillReport
    code = program_cache.ProgramCode(_ProgramWithConstants(), FastPrefillReport(cut=True), [], "")
    with FakeTensorMode():
        code.prepare_for_serialization()
    assert code.program is None
    with FakeTensorMode():
        code.post_compile([], None, None)
    assert not isinstance(code.program.constant, FakeTensor)
    assert code.env is not None  # loaded outside a backend: it counts its run-time fallbacks itself
    torch.testing.assert_close(code.program.constant, torch.tensor([0.95, 2.0]))
    assert code.program.on_device.values.tolist() == [1, 2, 3, 4]


def test_a_program_that_cannot_be_saved_runs_and_is_counted(tmp_path, monkeypatch):
    """The whole way: the program does not pickle, AOTAutograd saves nothing, the model still runs
    cut and right, and the backend counts it."""
    from torch._dynamo.utils import counters

    from examples import hf_gemma4
    from fx_fastprefill.compilation.compile_graph import GraphCode

    def refuse(self):
        raise TypeError("cannot pickle 'StandIn' object")
    monkeypatch.setattr(GraphCode, "__getstate__", refuse)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    model = hf_gemma4.smallest()
    ids = torch.randint(1, model.config.vocab_size, (2, 11))
    backend = fx_fastprefill.backend(compiler="eager")
    with torch.no_grad():
        logits = torch.compile(model, backend=backend, dynamic=False)(ids, logits_to_keep=1).logits
        torch.testing.assert_close(logits, model(ids, logits_to_keep=1).logits)
    assert backend.reports[-1].cut and backend.fallbacks[fallbacks.PROGRAM_NOT_SAVED] == 1, dict(backend.fallbacks)
    assert not counters["aot_autograd"].get("autograd_cache_saved"), dict(counters["aot_autograd"])


def test_a_damaged_cache_entry_is_compiled_again(tmp_path, monkeypatch):
    """Issue 40: the program's AOTAutograd entries truncated between two compiles (a disk that
    filled up, a copy cut short): the second compile misses, compiles and saves again, cut and right."""
    from torch._dynamo.utils import counters

    from examples import hf_gemma4
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = hf_gemma4.smallest()
    ids = torch.randint(1, model.config.vocab_size, (2, 11))

    def compile_and_run() -> tuple[FastPrefillBackend, dict]:
        torch._dynamo.reset()
        counters.clear()
        backend = fx_fastprefill.backend(compiler="eager")
        with torch.no_grad():
            logits = torch.compile(model, backend=backend, dynamic=False)(ids, logits_to_keep=1).logits
            torch.testing.assert_close(logits, model(ids, logits_to_keep=1).logits)
        return backend, dict(counters["aot_autograd"])

    compile_and_run()
    entries = [p for p in (tmp_path / "aotautograd").rglob("*") if p.is_file()]
    assert entries
    for path in entries:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    backend, aot = compile_and_run()
    assert not aot.get("autograd_cache_hit") and aot.get("autograd_cache_saved") == 1, aot
    assert backend.reports[-1].cut and not backend.reports[-1].from_cache


def test_generated_codes_globals_are_named_by_how_to_import_them():
    """A split graph's code is pickled with its globals as import references (compile_graph.GraphCode)."""
    import math
    from fx_fastprefill.compilation.importable import reference_to, resolve

    def local():
        pass
    for value in (torch, torch.device, type(None), torch.ops.aten.mm.default.__class__, len):
        assert resolve(reference_to(value)) is value
    assert resolve(reference_to(math.inf)) == math.inf and math.isnan(resolve(reference_to(math.nan)))
    assert reference_to(local) is None and reference_to(object()) is None


def test_a_program_whose_saved_bytes_changed_is_refused_and_counted():
    """Issue 42: the program is saved behind its sha256; a flipped byte (which might still unpickle)
    is found on load: not loaded (AOTAutograd compiles again), counted on the loading backend."""
    from fx_fastprefill.report.report import FastPrefillReport

    code = program_cache.ProgramCode({"weights": [1.0, 2.0]}, FastPrefillReport(cut=True), [], "")
    code.prepare_for_serialization()
    sound = code._pickled
    damaged = bytearray(sound)
    damaged[len(damaged) // 2] ^= 0x01
    code._pickled = bytes(damaged)
    counted = fallbacks.FallbackCounter()
    with program_cache.caching("tag", lambda loaded: None), damaged_files.counted_by(counted.record):
        with pytest.raises(program_cache.DamagedArtifact, match="sha256 does not match"):
            code.post_compile([], None, {})
    assert counted == {fallbacks.PROGRAM_DAMAGED: 1} and code.program is None
    code._pickled = sound
    with program_cache.caching("tag", lambda loaded: None), damaged_files.counted_by(counted.record):
        code.post_compile([], None, {})
    assert code.program == {"weights": [1.0, 2.0]} and counted == {fallbacks.PROGRAM_DAMAGED: 1}


class _LaunchedKernel:
    """A stand-in for Inductor's autotuner once its launchers are made (the pickle protocol only)."""

    def __init__(self):
        self.launchers = ["launcher"]
        self._reload_kernel = lambda: None  # as Inductor's local closure: it does not pickle

    def prepare_for_pickle(self):
        old, self.launchers = self.launchers, []
        return old

    def restore_after_unpickle(self, old):
        self.launchers = old

    def __getstate__(self):
        assert not self.launchers, "pickle should not be called with after make_launchers()"
        return dict(self.__dict__)


def test_launched_bundle_kernels_pickle_and_keep_their_launchers():
    """The bundle's kernels pickle without launchers, and get them back after: the stand-in has
    Inductor's autotuner protocol (``launchers``, ``prepare_for_pickle``, ``restore_after_unpickle``)
    and its refusal to pickle once launched."""
    import pickle
    from types import SimpleNamespace

    from fx_fastprefill import torch_seams

    kernel = _LaunchedKernel()
    graph = SimpleNamespace(_triton_bundle=SimpleNamespace(static_autotuners=[SimpleNamespace(kernel=kernel)]))
    with pytest.raises(AssertionError, match="make_launchers"):
        pickle.dumps(kernel)
    with torch_seams.launched_kernels_picklable(graph):
        loaded = pickle.loads(pickle.dumps(kernel))
        assert loaded.launchers == [] and loaded._reload_kernel is None
    assert kernel.launchers == ["launcher"] and callable(kernel._reload_kernel)
    with torch_seams.launched_kernels_picklable(SimpleNamespace()):  # no bundle (CPU code): nothing to do
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_graph_loaded_from_inductors_cache_is_saved_on_the_gpu(tmp_path, monkeypatch):
    """The defect seen on the H100: the same graph compiled twice in one process is an FX-graph-cache
    hit the second time, whose bundled kernels already have launchers. Its saved form is made
    anyway and reloads to the same output."""
    import pickle

    from torch.fx.experimental.proxy_tensor import make_fx

    from fx_fastprefill.compilation import compile_graph
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(64, 128, device="cuda")
    w = torch.randn(128, 32, device="cuda")
    fn = lambda a, b: (torch.relu(a @ b) * a.sum(-1, keepdim=True),)  # noqa: E731
    launched = []
    for _ in range(2):
        gm = make_fx(fn, tracing_mode="fake")(x, w)
        with compile_graph.lowering(small_contractions=False, saving=True), compiling_in(fake_mode_of(gm)):
            boxed = compile_graph.compile_boxed(gm, "inductor")
        bundle = getattr(boxed.code, "_triton_bundle", None)
        launched.append(sum(bool(getattr(e.kernel, "launchers", None))
                            for e in getattr(bundle, "static_autotuners", None) or ()))
        assert isinstance(boxed.saved, bytes), boxed.saved
        out = boxed([x, w])[0]
    print("bundled kernels with launchers at compile time, first and second compile:", launched)
    loaded = pickle.loads(pickle.dumps(boxed))
    torch.testing.assert_close(loaded([x, w])[0], out, rtol=0, atol=0)
    torch.testing.assert_close(out, fn(x, w)[0], rtol=1e-4, atol=1e-4)
