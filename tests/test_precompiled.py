"""``compile_for_generate(precompile=...)`` (compilation/precompiled.py): the prefill and decode
saved whole and loaded by the next process.

- A cold process compiles and saves both paths (batches of 1 and 2: two functions per path); a
  warm one on the same folder loads them, traces nothing, is cut, and generates the tokens of the
  model without the pass at new prompt lengths; a cache passed in from an earlier call misses the
  prefill's guards and compiles another, counted. (Subprocesses: what is tested is a restart.)
- ``Runner(precompile=...)``: a warm process loads the model's saved graph, traces nothing,
  replays the steps of the model without the pass.
- In one process: the key follows the model's config, dtype and the options; a file that does not
  load is skipped, counted; a backend that cannot be keyed does not precompile, counted.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import fx_fastprefill
from fx_fastprefill import fallbacks
from fx_fastprefill.compilation import precompiled
from tests.children import run_child

pytestmark = pytest.mark.program_cache
# The decode backend of the CPU tests: Dynamo only (no Inductor compile), except on torch 2.11, which
# cannot save an eager-backend function ("Unexpected raw Node during pickling", its GraphModule pickler).
CPU_DECODE_BACKEND = "eager" if torch.__version__ >= "2.13" else "inductor"


def _child(cache_dir: Path, *args: str) -> dict:
    return run_child("tests.precompile_child", cache_dir, *args)


def _restart(tmp_path: Path, device: str) -> None:
    pytest.importorskip("transformers")
    folder, cache = str(tmp_path / "precompiled"), tmp_path / "cache"
    # On the CPU the decode is precompiled with CPU_DECODE_BACKEND (eager: Dynamo's function saved and
    # loaded the same way, without two more Inductor compiles); the GPU test runs Inductor's CUDA graphs.
    decode = ["--device", device, "--decode-backend", "inductor" if device == "cuda" else CPU_DECODE_BACKEND]
    cold = _child(cache, folder, "--batches", "1,2", *decode)
    assert cold["loaded"] == {"prefill": 0, "decode": 0}, cold
    assert cold["compiled"] == {"prefill": 2, "decode": 2}, cold  # batch 1, then batch-dynamic
    # The static cache's K/V shapes (a fake-tensor probe of the model) are kept for the next start too.
    assert len(list((tmp_path / "precompiled").glob("kv-shapes-*.json"))) == 1
    assert all(cold["equal"]) and all(cold["cut"]) and cold["fallbacks"] == {
        fallbacks.PRECOMPILED_GUARD_MISS: 2}, cold
    # torch 2.11's C++ Inductor miscompiles this model's DynamicCache prefill with or without the
    # package (an undeclared temporary in the generated code): that step needs 2.13 on the CPU.
    dynamic_cache = device == "cuda" or torch.__version__ >= "2.13"
    # Other weights (a checkpoint of the same model): the saved functions read the model's parameters.
    warm = _child(cache, folder, "--batches", "1,3,2", "--seed", "2", "--weights-seed", "3", *decode,
                  *(["--dynamic-cache"] if dynamic_cache else []))
    # Files load as calls need them: batch 1 runs the first function of each path, batch 3 the second.
    assert warm["loaded_by_the_first_generate"] == {"prefill": 1, "decode": 1}, warm
    assert warm["loaded"] == {"prefill": 2, "decode": 2} and warm["compiled"] == {"prefill": 0, "decode": 0}, warm
    assert warm["graphs"] == 0 and warm["compiles"] == {"prefill": 0, "decode": 0}, warm  # nothing traced
    assert all(warm["equal"]) and warm["cut"] and all(warm["cut"]) and all(warm["from_cache"]), warm
    assert warm["fallbacks"] == {} and "2 loaded, 0 compiled" in warm["summary"], warm
    # Kernels reloaded under the user's cache tag, the one their autotuning results are keyed with.
    assert warm["reload_tags"] == ["a-users-tag"], warm
    if device == "cuda":
        assert cold["autotuned"] > 0 and warm["autotuned"] == 0, (cold["autotuned"], warm["autotuned"])
    if not dynamic_cache:
        return
    dynamic = warm["dynamic_cache"]
    assert dynamic["equal"] and dynamic["compiled"] == 1, dynamic
    assert dynamic["fallbacks"] == {fallbacks.PRECOMPILED_GUARD_MISS: 1}, dynamic


@pytest.mark.slow
def test_a_warm_generate_loads_both_paths_and_traces_nothing(tmp_path):
    _restart(tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_warm_generate_on_the_gpu_loads_both_paths(tmp_path):
    """The decode with CUDA graphs (Inductor's reduce-overhead) loaded from its file (fp32: the
    tokens are compared with eager's)."""
    _restart(tmp_path, "cuda")


@pytest.mark.slow
def test_a_warm_runner_loads_its_model_and_traces_nothing(tmp_path):
    """``Runner(precompile=...)``: the cold process compiles and saves the model's one graph (every
    step size, piecewise graphs with the stand-in recorder); the warm one, with other weights,
    loads it, traces nothing, is cut, and replays the steps of the model without the pass."""
    folder = str(tmp_path / "precompiled")
    cold = run_child("tests.runner_precompile_child", tmp_path / "cache", folder)
    assert (cold["loaded"], cold["compiled"], cold["graphs"], cold["from_cache"]) == (0, 1, 1, False), cold
    warm = run_child("tests.runner_precompile_child", tmp_path / "cache", folder, "--weights-seed", "3")
    assert (warm["loaded"], warm["compiled"], warm["graphs"], warm["failed"]) == (1, 0, 0, None), warm
    assert warm["cut"] and warm["from_cache"] and warm["replays"] > 0, warm
    # The same fallbacks as the cold run (graph warm-ups), no precompile fallback among them.
    assert warm["fallbacks"] == cold["fallbacks"] and not any("precompile" in r for r in warm["fallbacks"]), warm
    for run in (cold, warm):
        assert run["max_abs_err"] < 1e-5, run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_warm_runner_with_cuda_graphs_on_the_gpu_loads_its_program_saved_whole(tmp_path):
    """The Runner with Inductor's pieces and real CUDA graphs: the cold process saves its program
    (none of it unpicklable, nothing counted as not saved); the warm one loads it, traces nothing,
    records its graphs again and computes what the model computes without the pass."""
    folder = str(tmp_path / "precompiled")
    cold = run_child("tests.runner_precompile_child", tmp_path / "cache", folder, "--cuda")
    assert (cold["loaded"], cold["compiled"], cold["from_cache"]) == (0, 1, False), cold
    warm = run_child("tests.runner_precompile_child", tmp_path / "cache", folder, "--weights-seed", "3", "--cuda")
    assert (warm["loaded"], warm["compiled"], warm["graphs"], warm["failed"]) == (1, 0, 0, None), warm
    assert warm["cut"] and warm["from_cache"], warm
    for run in (cold, warm):
        assert fallbacks.PROGRAM_NOT_SAVED not in run["fallbacks"], run
        assert fallbacks.CUDAGRAPH_RECORD_FAILED not in run["fallbacks"], run
        assert run["max_abs_err"] < 1e-4, run  # fp32, Inductor's pieces against eager


def test_a_runner_precompiles_only_a_compiled_model(tmp_path):
    from examples.gemma3n import tiny
    with pytest.raises(ValueError, match="precompile needs a compiled model"):
        fx_fastprefill.Runner(tiny(), max_num_tokens=16, precompile=tmp_path)
    with pytest.raises(TypeError, match="precompile must be a bool or a folder"):
        fx_fastprefill.Runner(tiny(), backend="inductor", max_num_tokens=16, precompile=3)


def test_the_key_follows_the_config_dtype_and_options():
    from examples import hf_gemma4
    model = hf_gemma4.smallest()
    key = precompiled.model_key(model, "options")
    assert precompiled.model_key(model, "options") == key
    assert precompiled.model_key(model, "other options") != key
    assert precompiled.model_key(model.to(torch.bfloat16), "options") != key
    assert precompiled.model_key(hf_gemma4.tiny(**hf_gemma4.SMALLEST, sliding_window=6), "options") != key
    # A method patched on a module's instance (its identity guard is not saved): another key.
    patched = hf_gemma4.smallest()
    mlp = patched.model.layers[0].mlp
    mlp.forward = lambda x: type(mlp).forward(mlp, x) * 2
    assert precompiled.model_key(patched, "options") != key
    assert fx_fastprefill.backend().cache_tag != fx_fastprefill.backend(narrow_slices=False).cache_tag


def _precompiled_forward(model, folder, **options) -> precompiled.PrecompiledFunction:
    backend = options.pop("backend", None) or fx_fastprefill.backend()
    return precompiled.PrecompiledFunction(
        model.forward, name="prefill", folder=folder, options_key=str(backend.cache_tag),
        compile_options={"backend": backend}, fallback=model.forward, record_fallback=backend.fallbacks.record,
        keyable=backend.cache_tag is not None, **options), backend


def test_a_file_that_does_not_load_is_skipped_and_counted(tmp_path):
    from examples import hf_gemma4
    model = hf_gemma4.smallest()
    backend = fx_fastprefill.backend(compiler="eager")
    function, _ = _precompiled_forward(model, tmp_path, backend=backend)
    (tmp_path / f"prefill-{function.key}-truncated.bin").write_bytes(b"\x80\x04not a pickle")
    again, _ = _precompiled_forward(model, tmp_path, backend=backend)
    assert again.unloaded and not backend.fallbacks  # read at the first call, not before
    ids = torch.randint(3, model.config.vocab_size, (1, 7))
    with torch.no_grad():  # skipped, counted; the call compiles and saves a function of its own
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits)
    assert again.loaded == 0 and again.compiled == 1 and not again.failed
    assert backend.fallbacks == {fallbacks.PRECOMPILED_LOAD_FAILED: 1}


def test_a_saved_file_with_a_flipped_byte_is_dropped_and_compiled_again(tmp_path):
    """Issue 42: a saved function lies behind its sha256; one flipped byte is found before anything
    is unpickled: skipped, counted, the file removed, the path compiled and saved again."""
    from examples import hf_gemma4
    model = hf_gemma4.smallest()
    backend = fx_fastprefill.backend(compiler="eager")
    function, _ = _precompiled_forward(model, tmp_path, backend=backend)
    ids = torch.randint(3, model.config.vocab_size, (1, 7))
    with torch.no_grad():
        function(input_ids=ids)
    [saved] = tmp_path.glob(f"prefill-{function.key}-*.bin")
    data = bytearray(saved.read_bytes())
    data[len(data) // 2] ^= 0x10
    saved.write_bytes(bytes(data))
    again, _ = _precompiled_forward(model, tmp_path, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits)
    assert again.loaded == 0 and again.compiled == 1 and not saved.exists()
    assert backend.fallbacks.get(fallbacks.PRECOMPILED_LOAD_FAILED) == 1, backend.fallbacks
    assert len(list(tmp_path.glob(f"prefill-{function.key}-*.bin"))) == 1  # the new one


def test_builtins_are_in_the_traced_modules_globals_only_while_compiling_on_old_torch():
    """torch 2.11's aot_compile looks builtins up in the traced function's globals: they are put there
    for the compile (never over a name the module defines) and taken out after; 2.13+ needs nothing."""
    module_globals = {"x": 1, "type": "the module's own"}
    with precompiled._builtins_resolve(module_globals):
        if torch.__version__ >= "2.13":
            assert module_globals == {"x": 1, "type": "the module's own"}
        else:
            assert module_globals["len"] is len and module_globals["type"] == "the module's own"
            assert "__import__" not in module_globals
    assert module_globals == {"x": 1, "type": "the module's own"}


def test_a_backend_that_cannot_be_keyed_does_not_precompile(tmp_path):
    from examples import hf_gemma4
    from fx_fastprefill.passes.pipeline import PIPELINE
    model = hf_gemma4.smallest()
    unreadable = eval("lambda ctx: None")  # no source: the backend's programs cannot be keyed
    backend = fx_fastprefill.backend(compiler="eager", passes=[*PIPELINE, unreadable])
    function, backend = _precompiled_forward(model, tmp_path, backend=backend)
    assert function.failed and backend.fallbacks[fallbacks.PRECOMPILE_UNAVAILABLE] == 1
    ids = torch.randint(3, model.config.vocab_size, (1, 7))
    with torch.no_grad():  # the fallback (here the model itself) runs
        torch.testing.assert_close(function(input_ids=ids).logits, model(input_ids=ids).logits)
    assert not list(tmp_path.iterdir())


def test_a_compile_that_cannot_be_saved_still_serves_its_calls(tmp_path, monkeypatch):
    """Saving the compiled function fails (a global it reads that cannot be imported by name, say):
    the path falls back, counted, but the function just compiled serves the calls it fits; the
    compile is not paid again through the fallback."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    from examples import hf_gemma4

    def refuse(*args, **kwargs):
        raise TypeError("cannot pickle 'StandIn' object")
    monkeypatch.setattr(AOTCompiledFunction, "serialize", refuse)
    model = hf_gemma4.smallest()
    fallback_calls = []

    def fallback(*args, **kwargs):
        fallback_calls.append(kwargs["input_ids"].shape)
        return model.forward(*args, **kwargs)
    backend = fx_fastprefill.backend(compiler="eager")
    function = precompiled.PrecompiledFunction(
        model.forward, name="prefill", folder=tmp_path, options_key=str(backend.cache_tag),
        compile_options={"backend": backend}, fallback=fallback, record_fallback=backend.fallbacks.record)
    with torch.no_grad():
        for seq in (7, 7, 9):  # 9: the static-shape function's guards fail, the fallback runs it
            ids = torch.randint(3, model.config.vocab_size, (1, seq))
            torch.testing.assert_close(function(input_ids=ids, logits_to_keep=1).logits,
                                       model(input_ids=ids, logits_to_keep=1).logits)
    assert function.compiled == 1 and "not saved: TypeError" in function.failed
    assert function.state().endswith("; 1 function(s) in hand serve the calls they fit"), function.state()
    assert len(backend.reports) == 1 and backend.reports[0].cut  # compiled once, cut
    assert fallback_calls == [torch.Size([1, 9])]
    assert backend.fallbacks == {fallbacks.PRECOMPILE_FAILED: 1} and not list(tmp_path.glob("*.bin"))


USER_MODEL = '''
import transformers


class Edited(transformers.Gemma4ForCausalLM):
    def forward(self, *args, logits_to_keep=0, **kwargs):
        out = super().forward(*args, logits_to_keep=logits_to_keep, **kwargs)
        out.logits = out.logits.roll(SHIFT, -1)
        return out
'''

HELPER_CALLER = '''
import transformers

import user_helpers


class CallsAHelper(transformers.Gemma4ForCausalLM):
    def forward(self, *args, logits_to_keep=0, **kwargs):
        out = super().forward(*args, logits_to_keep=logits_to_keep, **kwargs)
        out.logits = user_helpers.adjust(out.logits)
        return out
'''


def _write_user_code(user_dir: Path, edited: bool) -> None:
    """The user's modules: a subclass, a helper it calls, an edited copy of transformers' Gemma 4
    modeling file in a package of version 1.0 (before and after the edit)."""
    import re

    import transformers.models.gemma4.modeling_gemma4 as original
    (user_dir / "user_model.py").write_text(USER_MODEL.replace("SHIFT", "5" if edited else "1"))
    (user_dir / "user_helper_caller.py").write_text(HELPER_CALLER)
    (user_dir / "user_helpers.py").write_text(
        f"def adjust(logits):\n    return logits.roll({7 if edited else 2}, -1)\n")
    package = user_dir / "gemma4_copy"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text('__version__ = "1.0"\n')
    source = Path(original.__file__).read_text()
    for relative, absolute in (("...", "transformers"), ("..", "transformers.models"),
                               (".", "transformers.models.gemma4")):
        source = re.sub(rf"^(\s*)from {re.escape(relative)}([\w.]*) ",
                        lambda m: f"{m[1]}from {absolute}{'.' + m[2] if m[2] else ''} ", source, flags=re.M)
    mlp = source.index("class Gemma4TextMLP")
    line = "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
    at = source.index(line, mlp)
    if edited:  # the text MLP's up projection negated
        source = source[:at] + line.replace("* self.up_proj", "* -self.up_proj") + source[at + len(line):]
    (package / "modeling_gemma4.py").write_text(source)


@pytest.mark.slow
def test_a_restart_after_the_models_code_is_edited_compiles_the_edited_code(tmp_path):
    """Issue 40, defects 1 and 2. The first process (which built a Llama first) saves every model's
    paths; the user then edits a subclass's forward, a helper module its forward calls, and a copy of
    transformers' modeling file (its package's version unchanged). The next process gives each edited
    model's own tokens (none is loaded: the key changes with a class's file, the helper is caught by
    the traced code's digests), and loads the unedited model, which it builds first."""
    pytest.importorskip("transformers")
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    folder, cache = str(tmp_path / "precompiled"), tmp_path / "cache"
    _write_user_code(user_dir, edited=False)
    cold = run_child("tests.edited_code_child", cache, folder, str(user_dir), "--other-class-first")
    for name, run in cold.items():
        assert run["equal"] and all(run["cut"]), (name, run)
        assert (run["compiled"], run["loaded"]) == (1, 0), run
    _write_user_code(user_dir, edited=True)
    warm = run_child("tests.edited_code_child", cache, folder, str(user_dir))
    for name, run in warm.items():
        assert run["equal"] and all(run["cut"]), (name, run)
        assert run["tokens"] != cold[name]["tokens"] or name == "plain", (name, "the edit changed nothing")
    # saved by a process that had built other classes first: loaded all the same
    assert warm["plain"]["loaded"] == 1 and warm["plain"]["fallbacks"] == {}, warm
    for name in ("subclass", "copy"):  # another key: nothing to load
        assert warm[name]["loaded"] == 0 and warm[name]["fallbacks"] == {}, warm[name]
    helper = warm["helper"]  # the same key; the file is read and refused: its traced code changed
    assert (helper["loaded"], helper["compiled"]) == (0, 1), helper
    assert helper["fallbacks"] == {fallbacks.PRECOMPILED_STALE: 1}, helper


def _generate_equals_the_uncompiled_model(folder, **options) -> dict:
    """compile_for_generate(precompile=folder) on the smallest Gemma 4 (static cache, eager regions
    and decode), greedy tokens against the same model uncompiled; the backend's fallbacks."""
    from examples import hf_gemma4
    torch.manual_seed(0)
    model, reference = hf_gemma4.smallest(), hf_gemma4.smallest()
    reference.load_state_dict(model.state_dict())
    fx_fastprefill.compile_for_generate(model, precompile=folder, compiler="eager", decode_backend=CPU_DECODE_BACKEND,
                                        **options)
    ids = torch.randint(3, model.config.vocab_size, (1, 9))
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(input_ids=ids, **greedy)
        expected = reference.generate(input_ids=ids, cache_implementation="static", **greedy)
    assert torch.equal(tokens, expected)
    return dict(model.fx_fastprefill.backend.fallbacks)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["a file", "under a file", "read-only"])
def test_a_folder_that_cannot_be_written_is_counted_not_raised(tmp_path, monkeypatch, caplog, form):
    """Issue 40, defect 3: the functions and the side file of K/V shapes cannot be written; the path
    runs the functions it compiled, counted, logged, never raising."""
    pytest.importorskip("transformers")
    folder = tmp_path / "precompiled"
    if form == "a file":
        folder.write_text("not a folder")
    elif form == "under a file":
        (tmp_path / "a-file").write_text("")
        folder = tmp_path / "a-file" / "precompiled"
    elif os.geteuid() != 0:
        folder.mkdir()
        folder.chmod(0o555)
    else:  # root writes through a read-only mode: the error such a folder raises, raised where it would be
        folder.mkdir()

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(folder))
        monkeypatch.setattr(precompiled.tempfile, "NamedTemporaryFile", refuse)
    with caplog.at_level("WARNING", logger="fx_fastprefill"):
        counted = _generate_equals_the_uncompiled_model(folder)
    # both paths' functions and the K/V shapes' file: not written, counted
    assert counted == {fallbacks.PRECOMPILE_FOLDER_FAILED: 3}, counted
    assert sum("not saved in" in r.getMessage() for r in caplog.records) == 2, caplog.text
    assert sum("not written" in r.getMessage() for r in caplog.records) == 1, caplog.text


@pytest.mark.slow
def test_damaged_files_in_the_folder_are_compiled_again(tmp_path):
    """A truncated function file and a K/V-shapes file that is not JSON: skipped (counted) and
    probed again, with the right tokens."""
    pytest.importorskip("transformers")
    _generate_equals_the_uncompiled_model(tmp_path)
    for path in tmp_path.glob("*.bin"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for path in tmp_path.glob("kv-shapes-*.json"):
        path.write_text("[[2, 16], [2")
    torch._dynamo.reset()
    counted = _generate_equals_the_uncompiled_model(tmp_path)
    assert counted == {fallbacks.PRECOMPILED_LOAD_FAILED: 2, fallbacks.PRECOMPILE_FOLDER_FAILED: 1}, counted
