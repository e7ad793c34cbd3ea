"""benchmarks/serve.py's serving loop on the CPU: continuous batching with chunked prefill, with
and without the pass, decode steps through whole-step graphs (the stand-in recorder of
tests/helpers.py), the same greedy tokens as the model run eagerly, request by request."""

from __future__ import annotations

import fx_fastprefill
from benchmarks.serve import SMOKE_WORKLOADS, Workload, make_requests, percentile, serve, summarize
from fx_fastprefill.compilation.backend import FastPrefillBackend
from tests.helpers import RerunRecorder, small_model


def _serve(backend, workload: Workload):
    options = {"token_pad_sizes": [2, 4, 8, 16, 32], "graph_recorder": RerunRecorder()} if backend is not None else {}
    runner = fx_fastprefill.Runner(small_model(), backend=backend, max_num_tokens=32, max_model_len=80, max_num_seqs=3,
                                   **options)
    requests = make_requests(workload, 512, seed=3)
    served = serve(runner, requests, workload, seed=3, progress=False)
    return runner, requests, summarize(requests, served)


def test_serve_with_and_without_the_pass_gives_the_eager_tokens():
    workload = SMOKE_WORKLOADS["mixed-c8"]  # 8 requests, prompts 4-60 (chunked at 32), concurrency 3
    _, requests, _ = _serve(None, workload)
    expected = [r.output for r in requests]
    eager = fx_fastprefill.Runner(small_model(), max_num_tokens=80, max_model_len=80)
    assert expected == [eager.generate([r.prompt], r.max_new_tokens)[0] for r in requests]  # one at a time
    for fast_prefill in (True, False):
        backend = FastPrefillBackend(compiler="eager", fast_prefill=fast_prefill, cudagraphs=True)
        runner, requests, summary = _serve(backend, workload)
        assert [r.output for r in requests] == expected, fast_prefill
        assert runner.report.cut == fast_prefill
        assert runner.step_counts["whole_step"] > 0 and runner.whole_step_graphs.replays > 0
        assert summary["num_requests"] == 8 and summary["output_tokens"] == sum(map(len, expected))
        assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p99_ms"] and 0 < summary["tpot_p50_ms"]


def test_poisson_arrivals_and_percentiles():
    workload = Workload(4, (3, 9), (2, 3), rate=200.0)
    _, requests, summary = _serve(None, workload)
    assert all(r.token_times[0] >= r.arrival > 0 for r in requests)
    assert [r.arrival for r in requests] == sorted(r.arrival for r in requests)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0
