"""The explain command on every example: text, JSON, the picture, bad arguments, logging."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fx_fastprefill
import fx_fastprefill.explain as explain
from examples import gemma3n

ROOT = Path(__file__).resolve().parents[1]

# What each example's config says: the trailing layers that read another layer's K/V.
EXPECTED = {
    "examples.gemma3n:tiny": {
        "eligible": [f"layers.{i}" for i, s in enumerate(gemma3n.kv_sources(gemma3n.Config())) if s is not None],
        "source_file": "gemma3n.py",
        # per_layer [T, 10 layers, 8]: layers 5-9 (the sharing run and the last K/V producer) read it on R rows
        "narrowed": [(1, [0, 5], [5, 10])],
    },
    "examples.yoco:tiny": {"eligible": ["cross.1", "cross.2"], "source_file": "yoco.py", "narrowed": []},
    "examples.dense:tiny": {"eligible": [], "source_file": "dense.py", "narrowed": []},
}


@pytest.fixture(scope="module", autouse=True)
def compile_each_example_once():
    """The command runs end to end; only the compile itself is shared between its calls on one example."""
    original = explain.compile_and_report
    reports = {}

    def compile_once_per_example(model, *, prompt_len=2048, **kw):
        # Keyed on the model's class: each factory call builds a new model of the same structure.
        key = (type(model), prompt_len, tuple(sorted(kw.items())))
        if key not in reports:
            reports[key] = original(model, prompt_len=prompt_len, **kw)
        return reports[key]

    explain.compile_and_report = compile_once_per_example
    yield
    explain.compile_and_report = original


def run_explain(capsys, *argv):
    assert explain.main(list(argv)) == 0
    return capsys.readouterr()


@pytest.mark.parametrize("spec", sorted(EXPECTED))
def test_json_names_layers_gathers_and_flops(capsys, spec):
    out = json.loads(run_explain(capsys, spec, "--format", "json", "--prompt-len", "512").out)
    expected = EXPECTED[spec]
    assert out["cut"] is True and out["reason"] == ""
    assert out["eligible_layers"] == expected["eligible"]
    names = [a["layer"] for a in out["attention_layers"]]
    # The reduced region is a suffix of the layers and holds every eligible layer.
    assert out["reduced_layers"] == names[len(names) - len(out["reduced_layers"]):]
    assert set(expected["eligible"]) <= set(out["reduced_layers"])
    assert out["prompt_len"] == 512
    assert 0.0 < out["flops_removed_fraction"] < 1.0
    assert out["flops_cut"] < out["flops_full"]
    for g in out["gathered"]:
        full, reduced = g["shape"].split(" -> ")
        assert "T" in full and "R" in reduced, g
    assert any(g["name"] == "positions" for g in out["gathered"])
    assert [(n["dim"], n["full"], n["reduced"]) for n in out["narrowed"]] == expected["narrowed"]
    for stop in out["stops"]:
        assert stop["op"] and stop["reason"]
    model_stops = [s for s in out["stops"] if s["op"] != "graph input"]
    assert model_stops and all(
        expected["source_file"] in s["source_line"] or "blocks.py" in s["source_line"] for s in model_stops
    )


@pytest.mark.parametrize("spec", sorted(EXPECTED))
def test_text_lists_every_layer_and_stop(capsys, spec):
    text = run_explain(capsys, spec, "--prompt-len", "512").out
    data = json.loads(run_explain(capsys, spec, "--format", "json", "--prompt-len", "512").out)
    for layer in data["attention_layers"]:
        assert f"  {layer['layer']}: " in text
    for stop in data["stops"]:
        assert f"  {stop['tensor']} ({stop['op']})" in text
        assert stop["reason"] in text
    assert f"prefill FLOPs removed at prompt length 512: {100 * data['flops_removed_fraction']:.1f}%" in text


def test_kv_stops_name_the_layers_they_feed(capsys):
    data = json.loads(run_explain(capsys, "examples.yoco:tiny", "--format", "json").out)
    kv_stops = [s for s in data["stops"] if s["feeds_kv_of"]]
    # YOCO's cross layers read cross.0's K/V, computed from the self-decoder's output on all rows.
    assert kv_stops and "cross.0" in kv_stops[0]["feeds_kv_of"]


def test_svg_and_png_pictures(capsys, tmp_path):
    svg, png = tmp_path / "cut.svg", tmp_path / "cut.png"
    run_explain(capsys, "examples.gemma3n:tiny", "--svg", str(svg))
    text = svg.read_text()
    assert "<svg" in text
    for word in ("layers.0", "layers.9", "boundary", "positions"):
        assert word in text
    run_explain(capsys, "examples.gemma3n:tiny", "--png", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_picture_without_matplotlib_says_so(capsys, tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    captured = run_explain(capsys, "examples.yoco:tiny", "--svg", str(tmp_path / "x.svg"))
    assert "no picture" in captured.err and "matplotlib" in captured.err
    assert "eligible layers" in captured.out
    assert not (tmp_path / "x.svg").exists()


@pytest.mark.parametrize("argv, message", [
    (["examples.gemma3n"], "expected MODULE:FACTORY"),
    (["no_such_module:tiny"], "cannot import module 'no_such_module'"),
    (["examples.gemma3n:no_such_factory"], "has no attribute 'no_such_factory'"),
    (["examples.gemma3n:Config"], "returned Config, expected a torch.nn.Module"),
    (["examples.gemma3n:tiny", "--prompt-len", "0"], "--prompt-len must be a positive"),
    (["examples.gemma3n:tiny", "--svg", "a.svg", "--png", "a.png"], "not allowed with"),
])
def test_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        explain.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_picture_path_must_be_svg_or_png(tmp_path):
    from fx_fastprefill.report.picture import draw_cut
    with pytest.raises(ValueError, match="must end in .svg or .png"):
        draw_cut(fx_fastprefill.FastPrefillReport(cut=False), tmp_path / "cut.pdf")


def test_command_line_with_torch_logs():
    """`python -m fx_fastprefill explain` in a fresh process; TORCH_LOGS=fx_fastprefill logs the report."""
    env = dict(os.environ, TORCH_LOGS="fx_fastprefill", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "fx_fastprefill", "explain", "examples.dense:tiny"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "reduced layers (queries on logits rows): layers.3" in proc.stdout
    assert "compiled a graph with 4 attention layers" in proc.stderr


def test_fallbacks_logged_once_then_counted(caplog):
    from examples import dense
    caplog.set_level(logging.INFO, logger="fx_fastprefill")
    runner = fx_fastprefill.Runner(dense.tiny(), backend=fx_fastprefill.backend(compiler="eager"),
                                   max_num_tokens=16, max_model_len=32)
    runner.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)
    reason = "pure decode batch (every row needs logits)"
    assert runner.fallbacks[reason] >= 3
    assert runner.report.fallbacks[reason] == runner.fallbacks[reason]
    infos = [r for r in caplog.records if r.levelno == logging.INFO and reason in r.getMessage()]
    assert len(infos) == 1
    assert any("compiled a graph" in r.getMessage() for r in caplog.records)


def test_env_var_switches_logging_on(monkeypatch):
    from fx_fastprefill import logs
    monkeypatch.setenv(logs.ENV_VAR, "verbose")
    with pytest.raises(ValueError, match="FX_FASTPREFILL_LOG must be one of"):
        logs.configure_logging()
    monkeypatch.setenv(logs.ENV_VAR, "debug")
    logs.configure_logging()
    try:
        assert logs.log.level == logging.DEBUG
        assert sum(getattr(h, "_fx_fastprefill", False) for h in logs.log.handlers) == 1
    finally:
        logs.log.setLevel(logging.NOTSET)
        logs.log.handlers = [h for h in logs.log.handlers if not getattr(h, "_fx_fastprefill", False)]


def _quickest_transformers_example() -> str:
    """Gemma 4 where transformers has it (it traces in about half Gemma 3n's time), else Gemma 3n."""
    try:
        import transformers
    except ImportError:
        return "hf_gemma3n"
    return "hf_gemma4" if hasattr(transformers, "Gemma4ForCausalLM") else "hf_gemma3n"


# One model: the rendering does not depend on it, and both models' reports (shared layers,
# sources, reduced layers) are checked in tests/test_transformers.py (CI time).
@pytest.mark.parametrize("example_name", [_quickest_transformers_example()])
def test_transformers_examples_in_text_and_json(capsys, monkeypatch, example_name):
    pytest.importorskip("transformers")
    import importlib
    # Both formats render the same reports: compile once (tracing a transformers model takes ~30 s).
    original, reports = explain.compile_and_report, []

    def compile_once(*args, **kwargs):
        if not reports:
            reports.extend(original(*args, **kwargs))
        return reports

    monkeypatch.setattr(explain, "compile_and_report", compile_once)
    example = importlib.import_module(f"examples.{example_name}")
    spec = f"examples.{example_name}:smallest"
    data = json.loads(run_explain(capsys, spec, "--format", "json").out)
    assert data["cut"] is True, data["reason"]
    assert data["eligible_layers"] == example.shared_layers(example.config(**example.SMALLEST))
    assert data["reduced_layers"][1:] == data["eligible_layers"]
    for g in data["gathered"]:  # every sequence's last row: T rows in, one row out (a mask keeps its T keys)
        full, reduced = g["shape"].split(" -> ")
        assert full.count("T") == reduced.count("T") + 1, g
    text = run_explain(capsys, spec).out
    for layer in data["attention_layers"]:
        assert f"  {layer['layer']}: " in text
    assert "reads the K/V of model.layers." in text
