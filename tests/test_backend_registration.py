"""The backend is reachable by name after install, and a Runner given the name keeps its reports."""

import torch

import fx_fastprefill
from examples.yoco import Config, YocoLike


def test_entry_point_registered():
    assert "fx_fastprefill" in torch._dynamo.list_backends(exclude_tags=())
    from fx_fastprefill.compilation.backend import fx_fastprefill_backend
    assert torch._dynamo.lookup_backend("fx_fastprefill") is fx_fastprefill_backend


def test_torch_compile_by_name_through_runner():
    torch.manual_seed(0)
    m = YocoLike(Config(n_self=2, n_cross=2))
    fast = fx_fastprefill.Runner(m, backend="fx_fastprefill", max_num_tokens=32)
    ref = fx_fastprefill.Runner(m, max_num_tokens=32)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    torch.testing.assert_close(fast.prefill(prompts), ref.prefill(prompts), rtol=1e-4, atol=1e-4)
    assert fast.report.cut
    assert fast.report.eligible_layers == ["cross.1"]
    assert fast.report.reduced_layers == ["cross.0", "cross.1"]
    assert 0.0 < fast.report.flops_removed_fraction < 1.0
    from fx_fastprefill.passes.pipeline import PIPELINE
    assert list(fast.report.pass_seconds) == [p.__name__ for p in PIPELINE]
    assert fast.report.to_dict()["pass_seconds"] == fast.report.pass_seconds


def test_reports_are_bounded():
    backend = fx_fastprefill.backend(compiler="eager", max_reports=2)
    compiled = torch.compile(torch.nn.Linear(4, 4), backend=backend, dynamic=False)
    for rows in (3, 5, 9):  # static shapes: one graph per size
        with torch.no_grad():
            compiled(torch.randn(rows, 4))
    assert len(backend.reports) == 2 and backend.reports.max_reports == 2
    assert all(not r.cut and "no attention" in r.reason for r in backend.reports)
