"""The benchmark helpers: speedups and issue 3's target checks from records (tables.py), device busy
time from a profiler trace (step_profile.py)."""

import json

import pytest

from benchmarks.tables import compile_s, speedups, targets


def record(variant, shape, ms, phase="prefill", **extra):
    batch, seq_len = shape
    return {"file": "r.json", "model": "m", "variant": variant, "batch": batch, "seq_len": seq_len,
            "median_ms": ms, "ideal_speedup": 1.5, "phase": phase, **extra}


def test_targets_report_met_and_missed():
    records = [
        record("inductor", (1, 8192), 90.0, first_call_s=60.09),
        record("inductor", (8, 4096), 300.0, first_call_s=20.3),  # a recompile for the new shape
        record("ffp_cudagraph", (1, 8192), 66.0, compile_and_capture_s=100.0),  # 1.36x: 0.91 of ideal
        record("ffp_cudagraph", (8, 4096), 200.0, compile_and_capture_s=100.0),  # 1.50x: 1.00 of ideal
        record("hand_split", (1, 8192), 63.0),
        record("hand_split", (8, 4096), 230.0),
        record("inductor", (1, 1), 20.0, phase="decode"),
        record("ffp_cudagraph", (1, 1), 20.8, phase="decode"),
    ]
    rows = speedups(records, "inductor")
    assert compile_s(rows, "m", "inductor") == 60.0 + 20.0
    table = targets(rows).splitlines()
    met = {line.split("|")[2].strip(): line.split("|")[4].strip() for line in table[2:]}
    assert met == {
        "1x8192: speedup >= 0.95 x ideal 1.50": "no",
        "8x4096: speedup >= 0.95 x ideal 1.50": "yes",
        "never > 1.03 x hand_split": "no",               # 66 / 63 = 1.048 at 1x8192
        "decode with the backend <= 1.02 x without": "no",  # 20.8 / 20 = 1.04
        "compile + capture <= 1.5 x inductor's": "yes",  # 100 s against 80 s
    }


def test_device_busy_time_is_the_union_of_kernel_intervals():
    from benchmarks.step_profile import device_busy_ms
    events = [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 10}, {"ph": "X", "cat": "gpu_memcpy", "ts": 5, "dur": 10},
              {"ph": "X", "cat": "cpu_op", "ts": 15, "dur": 100}, {"ph": "X", "cat": "kernel", "ts": 40, "dur": 5}]
    assert device_busy_ms(events) == (0.02, 0.045)  # 15 us + 5 us busy over a 45 us span, host ops ignored


def test_a_failed_variant_is_named_and_skipped(tmp_path, capsys):
    from benchmarks.tables import load
    path = tmp_path / "run.json"
    path.write_text(
        json.dumps(
            [
                record("inductor", (1, 8192), 90.0),
                {"model": "m", "variant": "ffp_cudagraph", "error": "Traceback ...\nAssertionError: stride"},
            ]
        )
    )
    records = load([str(path)])
    assert [r["variant"] for r in records] == ["inductor"]
    assert "m ffp_cudagraph failed: AssertionError: stride" in capsys.readouterr().err


def test_serve_targets_report_met_and_missed():
    from benchmarks.tables import serve_markdown, serve_targets

    def serve(model, variant, ttft, tpot, workload="vllm-8k"):
        return {"phase": "serve", "model": model, "workload": workload, "variant": variant, "ttft_p50_ms": ttft,
                "ttft_p99_ms": ttft, "tpot_p50_ms": tpot, "tpot_p99_ms": tpot, "throughput_tok_s": 1.0,
                "ideal_ttft_ratio": 0.5}
    records = [
        serve("gemma3n-e2b", "no_pass", 100.0, 4.0), serve("gemma3n-e2b", "ffp", 69.0, 4.1),   # 0.69 met; 1.025 not
        serve("gemma4-e2b", "no_pass", 100.0, 4.0), serve("gemma4-e2b", "ffp", 49.0, 4.0),     # 0.49 not met
        {"phase": "decode", "model": "gemma3n-e2b", "variant": "ffp", "graphs": "whole_step", "batch": 1,
         "median_ms": 1.9},
        {"phase": "decode", "model": "gemma3n-e2b", "variant": "ffp", "graphs": "whole_step", "batch": 64,
         "median_ms": 4.2},
    ]
    met = {(line.split("|")[1].strip(), line.split("|")[2].strip()): line.split("|")[4].strip()
           for line in serve_targets(records).splitlines()[2:]}
    assert met == {
        ("gemma3n-e2b", "decode step, batch 1 <= 2.0 ms"): "yes",
        ("gemma3n-e2b", "decode step, batch 64 <= 4.0 ms"): "no",
        ("gemma3n-e2b", "vllm-8k TTFT p50 <= 0.7 x no_pass"): "yes",
        ("gemma3n-e2b", "vllm-8k TPOT p50 <= 1.02 x no_pass"): "no",
        ("gemma4-e2b", "vllm-8k TTFT p50 <= 0.48 x no_pass"): "no",
        ("gemma4-e2b", "vllm-8k TPOT p50 <= 1.02 x no_pass"): "yes",
    }
    assert "| gemma3n-e2b | vllm-8k | ffp | 69.0 |" in serve_markdown(records)


@pytest.mark.slow
def test_roofline_flops_are_the_compiled_programs_graph_count():
    """benchmarks/roofline.py counts FLOPs from the config; the backend counts them from the graphs it
    compiled (uncut and cut, one prompt of ``prompt_len`` tokens, one logits row): the two agree,
    on a config whose shapes differ from the defaults (one K/V head, a window shorter than the prompt)."""
    import torch

    import fx_fastprefill
    from benchmarks.roofline import step_work
    from examples.gemma3n import Config, Gemma3nLike

    cfg = Config(n_layers=7, num_kv_shared_layers=3, n_kv_heads=1, n_heads=2, sliding_window=5, mlp_hidden=48,
                 pattern=3)
    torch.manual_seed(0)
    model = Gemma3nLike(cfg).eval()
    backend = fx_fastprefill.backend(prompt_len=24)
    runner = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=32, max_num_seqs=1)
    runner.prefill([[3] * 24])
    report = runner.report
    assert report.cut and report.prompt_len == 24
    uncut, cut = (step_work(cfg, [(24, 0)], c, elt=4) for c in (False, True))
    assert sum(w.flop for w in uncut.values()) == report.flops_full
    assert sum(w.flop for w in cut.values()) == report.flops_cut
    # Bytes: with no rows, what is left is the weights, each counted once (cut or not), the embedding
    # tables excepted (only their gathered rows move).
    tables = {"embed.weight", "per_layer_embed.weight"}
    weights = 4 * sum(p.numel() for name, p in model.named_parameters() if name not in tables)
    for c in (False, True):
        assert sum(w.bytes for w in step_work(cfg, [], c, elt=4).values()) == weights
    # The bytes no program avoids are the same cut or not (each key read once per layer either way):
    # the cut saves arithmetic and activations, which are not counted.
    assert sum(w.bytes for w in cut.values()) == sum(w.bytes for w in uncut.values())


def test_roofline_targets_report_met_and_missed():
    from benchmarks.tables import roofline_markdown, roofline_targets

    def rec(shape, phase, step_ms, mfu, of_bw, variant="ffp_cudagraph"):
        return {"model": "m", "shape": shape, "phase": phase, "variant": variant, "step_ms": step_ms, "tflop": 1.0,
                "achieved_tflops": 1.0, "mfu": mfu, "gbytes": 1.0, "achieved_gbps": 1.0,
                "of_bandwidth_bound": of_bw, "device_name": "card"}
    records = [rec("1x8192", "prefill", 40.0, 0.56, 0.01), rec("8x4096", "prefill", 40.0, 0.54, 0.01),
               rec("decode b1", "decode", 1.9, 0.0, 0.61), rec("decode b16", "decode", 2.7, 0.0, 0.5),
               rec("1x8192", "prefill", 90.0, 0.9, 0.0, variant="inductor")]
    rows = [line.split("|") for line in roofline_targets(records).splitlines()[2:]]
    met = {row[2].strip(): row[4].strip() for row in rows}
    assert met == {
        "1x8192 mfu >= 0.55": "yes", "8x4096 mfu >= 0.55": "no",
        "decode b1 <= 2.0 ms": "yes", "decode b1 of_bandwidth_bound >= 0.6 (goal)": "yes",
        "decode b16 <= 2.6 ms": "no", "decode b16 of_bandwidth_bound >= 0.6 (goal)": "no",
    }
    assert "| m | 1x8192 | inductor | 90.00 |" in roofline_markdown(records)
