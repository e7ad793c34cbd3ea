"""The step dispatcher (runtime/step_plan.py): every step's graph mode, padded sizes and reduced-region
mode decided in one place, and obeyed by what runs the step."""

from __future__ import annotations

import random

import pytest
import torch

from fx_fastprefill import SeqChunk
from fx_fastprefill import fallbacks
from fx_fastprefill.fallbacks import FallbackCounter
from fx_fastprefill.ops.kv_cache import KVCache
from fx_fastprefill.ops.step_context import (EAGER, PIECEWISE, REDUCED_ALL_ROWS, REDUCED_LOGITS_ROWS, REDUCED_SKIP,
                                             WHOLE_STEP, StepMetadata, plan_reduced_region)
from fx_fastprefill.runtime.step_plan import StepDispatcher
from fx_fastprefill.runtime.whole_step_graphs import MAX_ROWS_PER_REQUEST, WholeStepGraphs
from tests.helpers import RerunRecorder
from tests.helpers import PROMPTS, graphed_runner, plain_runner


def dispatcher(whole_step_sizes=(2, 4), compiled=True, token_pad_sizes=(4, 16, 64), logits_pad_sizes=(2, 4, 8, 64)):
    counter = FallbackCounter()
    graphs = None
    if whole_step_sizes:
        cache = KVCache(4, 32, "cpu", torch.float32, padding_slots=64)
        graphs = WholeStepGraphs(None, cache, whole_step_sizes, RerunRecorder(), counter.record, lambda: 0)
    return StepDispatcher(compiled=compiled, token_pad_sizes=token_pad_sizes, logits_pad_sizes=logits_pad_sizes,
                          whole_step=graphs, record_fallback=counter.record), counter


def test_decode_steps_are_planned_as_whole_step_graphs_of_the_smallest_size_that_holds_them():
    plans, counter = dispatcher()
    plan = plans.plan([1, 1, 1], 3)
    assert (plan.graph_mode, plan.padded_tokens, plan.padded_logits) == (WHOLE_STEP, 4, 4)
    assert plan.reduced.mode == REDUCED_LOGITS_ROWS and plan.reduced.fallback is None
    assert plans.plan([MAX_ROWS_PER_REQUEST], MAX_ROWS_PER_REQUEST).graph_mode == WHOLE_STEP  # draft rows
    assert not counter


def test_steps_a_whole_step_graph_cannot_take_run_piecewise_and_only_a_too_large_one_is_counted():
    plans, counter = dispatcher()
    too_large = plans.plan([1] * 5, 5)
    assert too_large.graph_mode == PIECEWISE and counter[fallbacks.WHOLE_STEP_TOO_LARGE] == 1
    assert plans.plan([MAX_ROWS_PER_REQUEST + 1], MAX_ROWS_PER_REQUEST + 1).graph_mode == PIECEWISE
    assert plans.plan([3, 1], 2).graph_mode == PIECEWISE                   # prompt rows without logits
    assert plans.plan([1, 1], 2, has_padding_request=True).graph_mode == PIECEWISE  # a capture's own step
    assert counter[fallbacks.WHOLE_STEP_TOO_LARGE] == 1 and sum(counter.values()) == 1


def test_a_size_whose_recording_failed_is_planned_piecewise_and_counted_each_step():
    plans, counter = dispatcher()
    plans.whole_step.lifecycle.failed(2)
    for _ in range(2):
        assert plans.plan([1, 1], 2).graph_mode == PIECEWISE
    assert counter[fallbacks.WHOLE_STEP_RECORD_FAILED] == 3  # the failure, then each step planned around it
    assert plans.plan([1, 1, 1], 3).graph_mode == WHOLE_STEP  # the other size still records


def test_piecewise_and_eager_steps_pad_as_the_compiled_graphs_are_keyed():
    plans, _ = dispatcher(whole_step_sizes=())
    plan = plans.plan([10], 1)
    assert (plan.graph_mode, plan.padded_tokens, plan.padded_logits, plan.reduced.mode) == \
        (PIECEWISE, 16, 2, REDUCED_LOGITS_ROWS)
    assert plans.plan([1], 1).padded_tokens == 4  # never one row: Dynamo would specialize it
    assert plans.plan([70], 1).padded_tokens == 70  # past every size: as it is
    skip = plans.plan([10], 0)
    assert skip.reduced.mode == REDUCED_SKIP and skip.reduced.fallback == fallbacks.NO_LOGITS_ROWS
    assert plans.plan([1, 1], 2).reduced.fallback == fallbacks.PURE_DECODE
    assert plans.plan([4], 3).reduced.fallback == fallbacks.NOT_SMALLER  # R=3 pads to 4 logits rows of 4
    eager = dispatcher(whole_step_sizes=(), compiled=False)[0].plan([10], 3)
    assert (eager.graph_mode, eager.padded_tokens, eager.padded_logits) == (EAGER, 10, 4)


def test_the_plan_is_the_gate_s_rule_on_the_padded_sizes():
    """The reduced region's gate, given a step without a plan, derives the same plan from the step
    and the sizes it is called with: one rule, decided before the step by the dispatcher."""
    rng = random.Random(0)
    plans, _ = dispatcher(whole_step_sizes=())
    for _ in range(300):
        lengths = [rng.randint(1, 20) for _ in range(rng.randint(1, 4))]
        num_logits = rng.randint(0, sum(lengths))
        plan = plans.plan(lengths, num_logits)
        meta = StepMetadata(query_start=[0, plan.padded_tokens], context_lens=[0], slot_base=[0], kv_cache=None,
                            num_logits=num_logits, has_prefill=num_logits < sum(lengths))
        assert plan_reduced_region(meta, plan.padded_logits, plan.padded_tokens) == plan.reduced, (lengths, plan)
        meta.reduced = plan.reduced
        assert plan_reduced_region(meta, 0, 0) is plan.reduced  # a step's own plan is obeyed, not re-derived
    assert plan_reduced_region(None, 4, 16).mode == REDUCED_ALL_ROWS  # outside any step: every row


class FailingRecorder(RerunRecorder):
    def capture(self, fn, args, pool):
        raise RuntimeError("recording refused (a test)")


def test_a_failed_whole_step_recording_gives_the_step_its_logits_and_later_steps_run_piecewise():
    plain = plain_runner()
    runner, backend, _ = graphed_runner(whole_step_sizes=[2])
    runner.whole_step_graphs.recorder = FailingRecorder()
    for r in (plain, runner):
        r.step([SeqChunk(0, PROMPTS[0], 1), SeqChunk(1, PROMPTS[1], 1)])
    for token in range(4):  # warm up, the failed recording, then piecewise
        step = [SeqChunk(0, [token + 3]), SeqChunk(1, [token + 4])]
        torch.testing.assert_close(runner.step(step), plain.step(step), rtol=1e-5, atol=1e-5)
    assert runner.whole_step_graphs.lifecycle.states == {2: "failed"}
    assert runner.step_counts[WHOLE_STEP] == 2 and runner.step_counts[PIECEWISE] == 3
    assert backend.fallbacks[fallbacks.WHOLE_STEP_RECORD_FAILED] == 3


def test_whole_step_graphs_refuse_a_size_the_plan_could_not_have_given():
    runner, _, _ = graphed_runner(whole_step_sizes=[2, 4])
    with pytest.raises(ValueError, match="planned for a whole-step graph of 3 rows"):
        runner.whole_step_graphs.run([1, 2], [0, 0], [0, 16], 3)


def test_graph_recording_is_refused_by_one_rule_for_the_runner_and_the_backend():
    from fx_fastprefill.compilation.cudagraphs import recording_refusal
    assert recording_refusal("eager", True, None) == fallbacks.CUDAGRAPHS_NEED_INDUCTOR
    assert recording_refusal("inductor", False, None) == fallbacks.CUDAGRAPHS_NOT_CUDA
    assert recording_refusal("eager", False, RerunRecorder()) is None
    assert recording_refusal("inductor", True, None) is None
