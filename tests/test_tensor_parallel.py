"""Tensor parallelism on 2 CPU ranks (gloo): the cut goes through the collectives.

transformers' own TP (``from_pretrained(..., tp_plan="auto")``) on saved random-weight Gemma 3n
and Gemma 4 checkpoints (a Llama one for the disagreement check), and the flat example model
sharded by examples/tp.py and run by the Runner on every rank. On each rank: cut, the KV-shared
layers reduced, fp32 logits equal to the single-process model and to TP eager, greedy tokens equal
to the single-process model's, the same plan fingerprint on both ranks. Ranks that plan
different cuts both compile unchanged.

Every check runs in one spawn of 2 processes (a module-scoped fixture): a spawn costs seconds of
imports; the compiles use ``compiler="eager"``.
"""

from __future__ import annotations

import copy
import os
import pickle
import tempfile

import pytest
import torch

import fx_fastprefill
from fx_fastprefill.fallbacks import PRECOMPILE_UNAVAILABLE, RANKS_DISAGREE
from fx_fastprefill.compilation.spmd import DISAGREE
from tests.distributed import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' tensor parallelism needs it

WORLD = 2
TOL = 1e-5
LENGTHS = [11, 9]  # longer than the tiny Gemmas' sliding window (8)
# The generate checks; Llama's checkpoint serves the disagreement check (a dense model under TP is
# the same hoisting through all-reduces, without KV sharing; kept out for the suite's time).
TP_MODELS = ("gemma3n", "gemma4")


def _factories():
    from examples import hf_gemma3n, hf_gemma4
    from examples.hf_zoo import ARCHITECTURES
    return {"gemma3n": lambda: hf_gemma3n.tiny(**hf_gemma3n.SMALLEST),
            "gemma4": lambda: hf_gemma4.tiny(**hf_gemma4.SMALLEST),
            "llama": ARCHITECTURES["llama"][1]}


def _load(path: str, **kwargs):
    from transformers import AutoModelForCausalLM

    from examples.hf_gemma4 import without_hand_slicing
    return without_hand_slicing(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval())


def _rel_err(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x - reference).abs().max() / reference.abs().max()).item()


def _rank_checks(rank: int, checkpoints: dict[str, str]) -> dict:
    from examples.hf_check import left_padded_batch
    results = {}
    for name, path in checkpoints.items():
        if name not in TP_MODELS:
            continue
        torch._dynamo.reset()  # transformers' models share one forward wrapper: a fresh recompile budget each
        single, model = _load(path), _load(path, tp_plan="auto")
        ids, mask = left_padded_batch(LENGTHS, model.config.get_text_config().vocab_size, pad_id=0, seed=1)
        greedy = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            tp_eager = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1]
            expected = single.generate(**greedy, cache_implementation="dynamic")
            # A DynamicCache (decode uncompiled) and a static-shape prefill: what is checked here is the
            # cut through the collectives (prompt lengths sharing a graph: tests/test_generate.py).
            fx_fastprefill.compile_for_generate(model, cache_implementation="dynamic", compiler="eager")
            model.forward.prompt_dynamic = False
            out = model.generate(**greedy)
        report = model.fx_fastprefill.reports[0]  # the prefill's (the first token's logits come from it)
        results[name] = dict(
            cut=report.cut, reason=report.reason, summary=report.summary(), ranks=report.ranks,
            shared=[a.layer for a in report.attention_layers if a.kv_source],
            eligible=report.eligible_layers, reduced=report.reduced_layers,
            err_vs_single=_rel_err(out.logits[0], expected.logits[0]),
            err_vs_tp_eager=_rel_err(out.logits[0], tp_eager),
            tokens_equal=torch.equal(out.sequences, expected.sequences),
            generate_cut=[r.cut for r in model.fx_fastprefill.reports])
    # Ranks that plan differently: rank 1 turns the pass off, so both must compile unchanged.
    torch._dynamo.reset()
    model = _load(checkpoints["llama"], tp_plan="auto")
    ids, mask = left_padded_batch(LENGTHS, model.config.vocab_size, pad_id=0, seed=2)
    backend = fx_fastprefill.backend(compiler="eager", fast_prefill=rank == 0)
    with torch.no_grad():
        prefill = dict(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)
        logits = torch.compile(model.forward, backend=backend)(**prefill).logits
        reference = model(**prefill).logits
    report = backend.reports[-1]
    results["disagree"] = dict(cut=report.cut, reason=report.reason, ranks=report.ranks,
                               fallbacks=dict(backend.fallbacks), err=_rel_err(logits, reference))
    torch._dynamo.reset()
    results["flat"] = _flat_checks()
    return results


def _flat_checks() -> dict:
    from examples.gemma3n import tiny
    from examples.tp import apply_tensor_parallel
    full = tiny()
    model = apply_tensor_parallel(copy.deepcopy(full))
    prompts = [[(7 * i + j) % 500 + 1 for j in range(12 + 3 * i)] for i in range(3)]
    backend = fx_fastprefill.backend(compiler="eager")
    # Precompiling is refused on several ranks (a loaded function would skip the ranks' check):
    # the Runner compiles through torch.compile as without it, counted.
    with tempfile.TemporaryDirectory() as folder:
        runner = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=64, precompile=folder)
        reference = fx_fastprefill.Runner(full, backend="eager", max_num_tokens=64)
        logits, expected = runner.prefill(prompts), reference.prefill(prompts)
        tokens = runner.generate(prompts, max_new_tokens=5)
        files = os.listdir(folder)
    prefill_report = backend.reports[0]
    return dict(precompile_refused=runner.precompiled.failed, files=files,
                fallbacks=dict(backend.fallbacks),
                cut=prefill_report.cut, reason=prefill_report.reason, summary=prefill_report.summary(),
                ranks=prefill_report.ranks, shared=[a.layer for a in prefill_report.attention_layers if a.kv_source],
                eligible=prefill_report.eligible_layers, reduced=prefill_report.reduced_layers,
                err_vs_single=_rel_err(logits, expected),
                tokens_equal=tokens == reference.generate(prompts, max_new_tokens=5))


def _run_all_checks(tmp_path_factory) -> list[dict]:
    checkpoints = {}
    for name, factory in _factories().items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        factory().save_pretrained(path)
        checkpoints[name] = str(path)
    return run_ranks(_rank_checks, WORLD, checkpoints)


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory, request):
    """The ranks' results, computed once per test session: under pytest-xdist the first worker to
    get here runs the ranks and the others read its results (the two ranks already fill two cores)."""
    worker = getattr(request.config, "workerinput", None)
    if worker is None:
        return _run_all_checks(tmp_path_factory)
    from filelock import FileLock
    shared = tmp_path_factory.getbasetemp().parent / "tensor_parallel_results.pkl"
    with FileLock(f"{shared}.lock"):
        if shared.is_file():
            return pickle.loads(shared.read_bytes())
        results = _run_all_checks(tmp_path_factory)
        shared.write_bytes(pickle.dumps(results))
        return results


def _check_rank_results(per_rank: list[dict]) -> None:
    for rank, result in enumerate(per_rank):
        print(f"rank {rank}:\n{result['summary']}")  # each rank's report, shown with -s or on failure
        assert result["cut"], (rank, result["reason"])
        assert result["eligible"] == result["shared"], rank
        assert set(result["shared"]) <= set(result["reduced"]), rank
        assert result["err_vs_single"] <= TOL, rank
        assert result["tokens_equal"], rank
        assert len(result["ranks"]) == WORLD and len(set(result["ranks"])) == 1, result["ranks"]
    assert per_rank[0]["ranks"] == per_rank[1]["ranks"]
    assert per_rank[0]["reduced"] == per_rank[1]["reduced"]


@pytest.mark.parametrize("name", TP_MODELS)
def test_transformers_tp_plan_is_cut_on_every_rank(hf_results, name):
    per_rank = [r[name] for r in hf_results]
    _check_rank_results(per_rank)
    for rank, result in enumerate(per_rank):
        assert result["err_vs_tp_eager"] <= TOL, rank
        assert result["generate_cut"] and all(result["generate_cut"]), (rank, result["generate_cut"])


def test_ranks_that_plan_different_cuts_all_compile_unchanged(hf_results):
    per_rank = [r["disagree"] for r in hf_results]
    for rank, result in enumerate(per_rank):
        assert not result["cut"] and result["reason"].startswith(DISAGREE), (rank, result["reason"])
        assert result["fallbacks"] == {RANKS_DISAGREE: 1}, rank
        assert len(set(result["ranks"])) == WORLD, result["ranks"]
        assert result["err"] <= TOL, rank


def test_flat_model_sharded_by_hand_is_cut_on_every_rank(hf_results):
    _check_rank_results([r["flat"] for r in hf_results])


def test_precompiling_is_refused_on_several_ranks(hf_results):
    for rank, result in enumerate(r["flat"] for r in hf_results):
        assert "runs on 2 ranks" in result["precompile_refused"], rank
        assert result["files"] == [] and result["fallbacks"].get(PRECOMPILE_UNAVAILABLE) == 1, (rank, result)
