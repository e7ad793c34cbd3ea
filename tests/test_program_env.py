"""The run-time env of compiled programs (compilation/program_env.py): programs are plain data;
their fallback sink, recorder and graph state come from whoever runs them."""

import gc
import pickle

import pytest

from fx_fastprefill.compilation import cudagraphs, program_env, regions
from fx_fastprefill.compilation.backend import FastPrefillBackend
from fx_fastprefill.fallbacks import FallbackCounter


class _Part:
    """Stands for a region: what an env keeps state for."""


def test_each_env_keeps_its_own_state_per_part_and_drops_it_with_the_part():
    first, second = FallbackCounter(), FallbackCounter()
    env_a, env_b = program_env.ProgramEnv(first.record), program_env.ProgramEnv(second.record)
    part = _Part()
    made = []
    state_a = env_a.state_of(part, lambda env: made.append(env) or object())
    assert env_a.state_of(part, lambda env: made.append(env) or object()) is state_a  # made once
    state_b = env_b.state_of(part, lambda env: made.append(env) or object())
    assert state_b is not state_a and made == [env_a, env_b]
    del part
    gc.collect()
    assert not env_a._states and not env_b._states  # a program gone takes its graphs with it


def test_the_running_env_and_recorder_nest_and_are_put_back():
    counter = FallbackCounter()
    env = program_env.ProgramEnv(counter.record)
    assert program_env.current() is program_env.UNOWNED and program_env.recorder() is None
    stand_in = object()
    with program_env.running(env), program_env.recording_with(stand_in):
        program_env.current().record_fallback("a reason")
        inner = program_env.ProgramEnv(FallbackCounter().record)
        with program_env.running(inner):
            assert program_env.current() is inner
        assert program_env.current() is env and program_env.recorder() is stand_in
    assert program_env.current() is program_env.UNOWNED and program_env.recorder() is None
    assert counter["a reason"] == 1


def test_compiled_programs_are_plain_data():
    """Nothing is bound into a program after a load, and nothing is left out when it pickles."""
    for cls in (regions.CompiledProgram, regions.StepGate, cudagraphs.PiecewiseRegion, cudagraphs.CUDAGraphPiece):
        assert "bind" not in vars(cls) and "__getstate__" not in vars(cls) and "__setstate__" not in vars(cls), cls
    piece = cudagraphs.CUDAGraphPiece(fn=len, static=[False], single=True, index=3)
    assert vars(pickle.loads(pickle.dumps(piece))) == vars(piece)


def test_the_recorder_is_not_a_compile_option_and_not_in_the_cache_key():
    assert FastPrefillBackend(cudagraphs=True).cache_tag == FastPrefillBackend(cudagraphs=True).cache_tag
    with pytest.raises(TypeError, match="graph_recorder"):
        FastPrefillBackend(cudagraphs=True, graph_recorder=object())


def test_the_mode_vocabularies_read_as_their_strings():
    import collections
    import json

    from fx_fastprefill.compilation import graph_lifecycle
    from fx_fastprefill.ops.step_context import GRAPH_MODES, WHOLE_STEP, ReducedMode
    counts = collections.Counter({WHOLE_STEP: 2})
    assert counts["whole_step"] == 2 and repr(counts) == "Counter({'whole_step': 2})"
    assert json.dumps(counts) == '{"whole_step": 2}' and f"{ReducedMode.SKIP}" == "skip"
    assert [str(m) for m in GRAPH_MODES] == ["whole_step", "piecewise", "eager"]
    assert graph_lifecycle.REPLAY == "replay" and graph_lifecycle.GraphAction("record") is graph_lifecycle.RECORD
