"""Bad input gets a specific error, and the same Runner then serves a good request correctly."""

import re

import pytest
import torch
from torch import nn

import fx_fastprefill
from fx_fastprefill import SeqChunk
from examples.blocks import Attention
from examples.dense import Config, Dense


def tiny():
    torch.manual_seed(0)
    return Dense(Config(n_layers=2))


def test_runner_errors_then_serves_correctly():
    m = tiny()
    ref = fx_fastprefill.Runner(m, max_num_tokens=16, max_model_len=32)
    runner = fx_fastprefill.Runner(
        m, backend=fx_fastprefill.backend(compiler="eager"), max_num_tokens=16, max_model_len=32
    )
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        runner.prefill([[1, 2], []])
    with pytest.raises(ValueError, match=r"prompt 0: token 1 is 512, outside the vocabulary \[0, 512\)"):
        runner.prefill([[1, 512]])
    with pytest.raises(ValueError, match="more than max_model_len=32"):
        runner.prefill([list(range(1, 40))])
    # A step's chunks are checked together; the error names the request with the bad token.
    with pytest.raises(ValueError, match=r"request 51: token 0 is -1, outside the vocabulary"):
        runner.step([SeqChunk(50, [1, 2]), SeqChunk(51, [-1, 3])])
    with pytest.raises(ValueError, match=r"request 50: token 1 is 2.0, outside the vocabulary"):
        runner.step([SeqChunk(50, [1, 2.0]), SeqChunk(51, [3])])
    with pytest.raises(ValueError, match="max_new_tokens=8 it needs 35 positions"):
        runner.generate([list(range(1, 28))], 8)
    with pytest.raises(IndexError, match=r"logits_indices\[0\] = 9 is out of range \[0, 4\)"):
        runner.step([SeqChunk(50, [1, 2, 3, 4])], logits_indices=[9])
    with pytest.raises(ValueError, match="strictly increasing"):
        runner.step([SeqChunk(50, [1, 2]), SeqChunk(51, [3, 4])], logits_indices=[3, 1])
    with pytest.raises(ValueError, match="not a suffix"):
        runner.step([SeqChunk(50, [1, 2, 3, 4])], logits_indices=[1])
    with pytest.raises(TypeError, match="list of token-id lists"):
        runner.prefill(torch.tensor([[1, 2]]))
    # a prompt longer than max_num_tokens is not an error: it is chunked
    prompt = list(range(1, 31))
    torch.testing.assert_close(runner.prefill([prompt]), ref.prefill([prompt]), rtol=1e-4, atol=1e-4)
    assert runner.generate([prompt[:5]], 4) == ref.generate([prompt[:5]], 4)


def test_backend_option_errors():
    with pytest.raises(ValueError, match="compiler must be one of"):
        fx_fastprefill.backend(compiler="tvm")
    with pytest.raises(TypeError, match="unknown options"):
        fx_fastprefill.backend(capture_sizes=[1])
    with pytest.raises(TypeError, match="draft_layers must be an iterable of layer names"):
        fx_fastprefill.backend(draft_layers="layers.9")


class TwoLayers(nn.Module):
    """A tiny flat model whose second layer reads the K/V named by ``kv_source``."""

    def __init__(self, kv_source, q_heads=4, head_dim=16, order=("a", "b")):
        super().__init__()
        self.vocab_size = 64
        self.embed = nn.Embedding(64, 32)
        self.a = Attention("a", 32, 4, 2, 16)
        self.b = Attention("b", 32, q_heads, 2, head_dim, kv_source=kv_source)
        self.order = order
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids, positions, logits_indices):
        x = self.embed(input_ids)
        for name in self.order:
            x = x + getattr(self, name)(x, positions)
        return self.head(x[logits_indices])


MODELS = {
    "unknown source": lambda: TwoLayers("zzz"),
    "source runs later": lambda: TwoLayers("a", order=("b", "a")),
    "heads do not fit": lambda: TwoLayers("a", q_heads=3),
    "head dims differ": lambda: TwoLayers("a", head_dim=8),
}


@pytest.mark.parametrize("case, error, message", [
    ("unknown source", RuntimeError, "reads kv_source='zzz', which has not written its cache in this step"),
    ("source runs later", RuntimeError, "reads kv_source='a', which has not written its cache in this step"),
    ("heads do not fit", ValueError, "has q of 3 heads x 16 but the cache it reads .'a'. holds 2 heads x 16"),
    ("head dims differ", ValueError, "has q of 4 heads x 8 but the cache it reads .'a'. holds 2 heads x 16"),
])
def test_kv_source_errors_eager(case, error, message):
    torch.manual_seed(0)
    runner = fx_fastprefill.Runner(MODELS[case](), max_num_tokens=16, max_model_len=32)
    with pytest.raises(error, match=message):
        runner.prefill([[1, 2, 3]])


@pytest.mark.parametrize("case, message", [
    ("unknown source", "names kv_source='zzz', but the graph has no attention layer of that name"),
    ("source runs later", "reads kv_source='a', which runs later in the graph"),
    ("heads do not fit", "has queries of 3 heads x 16, which do not fit the K/V of its kv_source 'a'"),
    ("head dims differ", "has queries of 4 heads x 8, which do not fit the K/V of its kv_source 'a'"),
])
def test_kv_source_errors_compiled(case, message):
    """Found when the graph is compiled, before any kernel runs: the user's error, not a fallback."""
    torch.manual_seed(0)
    runner = fx_fastprefill.Runner(MODELS[case](), backend=fx_fastprefill.backend(compiler="eager"), max_num_tokens=16,
                                   max_model_len=32)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failed:
        runner.prefill([[1, 2, 3]])
    assert isinstance(failed.value.inner_exception, ValueError), failed.value.inner_exception
    assert re.search(message, str(failed.value.inner_exception))


def test_graph_without_attention_is_left_unchanged():
    class NoAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

        def forward(self, input_ids, positions, logits_indices):
            return self.head(torch.relu(self.embed(input_ids))[logits_indices])

    torch.manual_seed(0)
    m = NoAttention()
    backend = fx_fastprefill.backend(compiler="eager")
    fast = fx_fastprefill.Runner(m, backend=backend, max_num_tokens=16)
    ref = fx_fastprefill.Runner(m, max_num_tokens=16)
    torch.testing.assert_close(fast.prefill([[1, 2, 3], [4, 5]]), ref.prefill([[1, 2, 3], [4, 5]]))
    report = backend.reports[0]
    assert "the graph has no attention the pass knows" in report.reason and not report.cut
