"""Golden graphs of the cut, printed by the canonical printer.

The full graphs live in tests/golden/*.txt; the short summaries are inline (expecttest). Both are
regenerated with EXPECTTEST_ACCEPT=1 after a deliberate change; review the diff.
"""

import os
from pathlib import Path

import expecttest
import torch

import fx_fastprefill
from fx_fastprefill.report.printer import print_cut_graph
from examples import dense, gemma3n, yoco

GOLDEN = Path(__file__).parent / "golden"
ACCEPT = os.environ.get("EXPECTTEST_ACCEPT") == "1"


def cut_report(model):
    torch._dynamo.reset()
    backend = fx_fastprefill.backend(compiler="eager", prompt_len=64)
    runner = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=32, max_model_len=64)
    runner.prefill([[1, 2, 3, 4, 5], [6, 7, 8]])
    return backend.reports[0]


def models():
    torch.manual_seed(0)
    return {
        "gemma3n": gemma3n.Gemma3nLike(
            gemma3n.Config(
                vocab_size=64,
                dim=16,
                n_layers=4,
                pattern=2,
                num_kv_shared_layers=2,
                n_heads=2,
                n_kv_heads=1,
                head_dim=4,
                mlp_hidden=32,
                num_streams=2,
                per_layer_dim=4,
                sliding_window=4,
            )
        ),
        "yoco": yoco.YocoLike(
            yoco.Config(
                vocab_size=64,
                dim=16,
                n_self=1,
                n_cross=2,
                n_heads=2,
                n_kv_heads=1,
                head_dim=4,
                mlp_hidden=32,
                sliding_window=4,
            )
        ),
        "dense": dense.Dense(
            dense.Config(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, mlp_hidden=32)
        ),
    }


class TestGoldenGraphs(expecttest.TestCase):
    def check_golden(self, name, text):
        path = GOLDEN / f"{name}.txt"
        if ACCEPT or not path.exists():
            if not ACCEPT:
                self.fail(f"{path} is missing: run with EXPECTTEST_ACCEPT=1 to write it")
            GOLDEN.mkdir(exist_ok=True)
            path.write_text(text + "\n")
        self.assertEqual(text + "\n", path.read_text(), f"cut graph of {name} changed (EXPECTTEST_ACCEPT=1 to accept)")

    def test_gemma3n(self):
        report = cut_report(models()["gemma3n"])
        self.check_golden("gemma3n", print_cut_graph(report))
        self.assertExpectedInline(
            summary(report),
            """\
eligible: layers.2, layers.3
reduced: layers.1, layers.2, layers.3
gathered: i64[T] -> i64[R]; f32[T, 16] -> f32[R, 16]; f32[T, 16] -> f32[R, 16]; i64[T] -> i64[R]; f32[T, 16] -> f32[R, 16]; f32[2, T, 16] -> f32[2, R, 16]""",  # noqa: E501
        )

    def test_yoco(self):
        report = cut_report(models()["yoco"])
        self.check_golden("yoco", print_cut_graph(report))
        self.assertExpectedInline(summary(report), """\
eligible: cross.1
reduced: cross.0, cross.1
gathered: f32[T, 16] -> f32[R, 16]; i64[T] -> i64[R]""")

    def test_dense(self):
        report = cut_report(models()["dense"])
        self.check_golden("dense", print_cut_graph(report))
        self.assertExpectedInline(summary(report), """\
eligible: none
reduced: layers.1
gathered: f32[T, 16] -> f32[R, 16]; i64[T] -> i64[R]; f32[T, 16] -> f32[R, 16]""")


def summary(report):
    return "\n".join([
        f"eligible: {', '.join(report.eligible_layers) or 'none'}",
        f"reduced: {', '.join(report.reduced_layers) or 'none'}",
        "gathered: " + "; ".join(g.shape for g in report.gathered),
    ])
