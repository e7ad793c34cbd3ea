"""Runner: owns the KV cache and runs the model one step at a time (the step API: ``step``,
``capture``, ``free``, ``resize_kv_cache``).

A step packs the new tokens of several requests into one flat batch (runtime/batch.py), so
prefill, chunked prefill and decode mix freely. The model sees
``forward(input_ids[T], positions[T], logits_indices[R])``. Whole requests (``prefill``,
``generate``) are scheduled into steps by runtime/scheduler.py.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from ..compilation import precompiled
from ..compilation.dynamic_shapes import compile_for_varying_sizes, varying_sizes
from ..compilation.program_env import GraphKeys, declared_keys, recording_with
from ..fallbacks import FallbackCounter
from ..ops import attention as _attention_kernels  # noqa: F401  (the ops' kernels, registered)
from ..ops.kv_cache import KVCache
from ..ops.step_context import WHOLE_STEP, StepMetadata, step_context, to_device
from .batch import (Request, SeqChunk, check_sizes, default_logits_indices, default_token_pad_sizes, pad_to_bucket,
                    padded_indices, power_of_two_buckets, step_tokens, validate_logits_indices, validate_step_tokens)
from .dynamo_guards import cheap_guards
from .requests import RequestTable
from .scheduler import Scheduler
from .step_plan import StepDispatcher, StepPlan
from .whole_step_graphs import WholeStepGraphs

if TYPE_CHECKING:
    from ..compilation.backend import FastPrefillBackend

log = logging.getLogger("fx_fastprefill")


def vocab_size_of(model: nn.Module) -> int | None:
    """The model's vocabulary size: a ``vocab_size`` attribute (its own, or its transformers
    config's), else the first embedding's rows; None when there is neither."""
    config = getattr(model, "config", None)
    for owner in (model, getattr(config, "text_config", None), config):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int):
            return size
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    return None


def package_backend(backend: Any) -> FastPrefillBackend | None:
    """``backend`` where it is this package's ``FastPrefillBackend`` (its CUDA-graph option, cache
    tag, loader, reports and fallbacks are what the Runner reads), else None. Its module is looked
    up, not imported: a backend of that class exists only once it is loaded."""
    module = sys.modules.get("fx_fastprefill.compilation.backend")
    return backend if module is not None and isinstance(backend, module.FastPrefillBackend) else None


class Runner:
    """Run a flat-batch model step by step, eagerly (``backend=None``) or through ``torch.compile``.

    ``max_num_tokens`` bounds the rows of one step (longer prompts are chunked); ``max_model_len``
    bounds one request (prompt plus generated tokens); ``max_num_seqs`` bounds the requests that
    hold a KV cache region at once. ``logits_pad_sizes`` are the sizes the logits rows are padded
    up to (powers of two by default; ``()`` disables padding). ``token_pad_sizes`` are the sizes a
    step's rows are padded up to, with rows of a padding request whose results are dropped: CUDA
    graphs are recorded per size, so with a backend made with ``cudagraphs=True`` they default to
    :func:`default_token_pad_sizes`; otherwise to none.

    ``whole_step_sizes``: with CUDA graphs, a step whose every row needs logits (decode, or up to
    ``MAX_ROWS_PER_REQUEST`` draft rows per request) runs as one whole-step graph, padded up to
    one of these row counts (runtime/whole_step_graphs.py); default: the step sizes up to the one
    that holds ``max_num_seqs`` rows; ``()`` turns them off. ``step_counts`` counts the steps of each kind.

    ``precompile``: save the compiled model whole (Dynamo's trace included) and load it in the
    next process, which then starts without tracing or compiling (compilation/precompiled.py):
    True for a folder in Inductor's cache folder, or a folder of your own. ``precompiled`` is then
    the saved path (what it loaded and compiled).

    ``graph_recorder``: records the graphs (whole-step and the regions' pieces) in place of CUDA
    graphs (compilation/cudagraphs.py: ``Recorder``; tests' stand-in on the CPU).
    """

    def __init__(self, model: nn.Module, *, backend: Any = None, max_num_tokens: int, max_model_len: int = 4096,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, max_num_seqs: int = 8,
                 logits_pad_sizes: Sequence[int] | None = None, token_pad_sizes: Sequence[int] | None = None,
                 whole_step_sizes: Sequence[int] | None = None, precompile: bool | str | os.PathLike = False,
                 graph_recorder: Any = None):
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be a positive int, got {max_num_tokens!r}")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size_of(model)
        self.logits_pad_sizes = list(
            power_of_two_buckets(max_num_tokens) if logits_pad_sizes is None else sorted(logits_pad_sizes)
        )
        self.backend = self._resolve_backend(backend)
        self._package = package_backend(self.backend)  # what the Runner reads of a backend: typed, or None
        self.cudagraphs = self._package is not None and self._package.cudagraphs
        if token_pad_sizes is None:
            token_pad_sizes = default_token_pad_sizes(max_num_tokens) if self.cudagraphs and max_num_tokens >= 2 else []
        elif self.backend is None and token_pad_sizes:
            raise ValueError("token_pad_sizes needs a compiled model (backend=...): eager steps are not padded")
        self.token_pad_sizes = check_sizes("token_pad_sizes", token_pad_sizes, max_num_tokens)
        self._recorder = self._graph_recorder(graph_recorder)
        # The regions record with the caller's recorder where one is given, else with CUDA graphs of
        # their own; only a given one says that a non-CUDA graph or compiler="eager" records.
        self._given_recorder = self._recorder if graph_recorder is not None else None
        if whole_step_sizes is None:
            largest = pad_to_bucket(max_num_seqs, self.token_pad_sizes)
            whole_step_sizes = [n for n in self.token_pad_sizes if n <= largest] if self._recorder is not None else []
        elif whole_step_sizes and self._recorder is None:
            raise ValueError("whole_step_sizes needs CUDA graphs: a backend made with cudagraphs=True, on CUDA")
        self.whole_step_sizes = check_sizes("whole_step_sizes", whole_step_sizes, max_num_tokens)
        folder = precompiled.folder_for(precompile)
        if folder is not None and self.backend is None:
            raise ValueError("precompile needs a compiled model (backend=...)")
        self._forward: Callable = model if self.backend is None else compile_for_varying_sizes(model, self.backend)
        self.precompiled: precompiled.PrecompiledFunction | None = None
        if folder is not None:
            self.precompiled = self._forward = self._precompiled_forward(folder)
        self.requests: RequestTable | None = None  # the live requests (made with the KV cache)
        self._step_id = 0
        self.step_counts: Counter[str] = Counter()  # steps by graph mode (ops/step_context.py: GRAPH_MODES)
        self.resize_kv_cache(max_num_seqs, max_model_len)

    def resize_kv_cache(self, max_num_seqs: int, max_model_len: int) -> None:
        """A new, empty KV cache for at most ``max_num_seqs`` requests of ``max_model_len`` tokens.

        The compiled model is kept (a benchmark sweeps shapes without recompiling); every request
        must have been freed first.
        """
        if self.requests:
            raise RuntimeError(
                f"resize_kv_cache: requests {list(self.requests)} still hold the cache; free them first"
            )
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        self.max_model_len = max_model_len
        # A compiled model never sees one token: Dynamo specializes size 1, so a lone decode token is
        # padded with a row of a padding request; steps are also padded up to ``token_pad_sizes``.
        # The padding request writes its K/V into slots of its own, after the requests' regions.
        self.kv_cache = self.whole_step_graphs = None  # let the old arrays go before the new ones are allocated
        padding_slots = max([2, *self.token_pad_sizes, *self.whole_step_sizes]) if self.backend is not None else 0
        self.kv_cache = KVCache(max_num_seqs, max_model_len, self.device, self.dtype, padding_slots=padding_slots)
        if self.requests is None:
            self.requests = RequestTable(self.kv_cache)
        self.requests.kv_cache = self.kv_cache  # empty (checked above): its ids count on
        self._padding = Request(-1, [], 0, self.kv_cache.padding_base) if self.backend is not None else None
        if self.whole_step_sizes:
            self.whole_step_graphs = WholeStepGraphs(self._forward_step, self.kv_cache, self.whole_step_sizes,
                                                     self._recorder, self._record_fallback, self._next_step_id)
        self.dispatcher = StepDispatcher(compiled=self.backend is not None, token_pad_sizes=self.token_pad_sizes,
                                         logits_pad_sizes=self.logits_pad_sizes, whole_step=self.whole_step_graphs,
                                         record_fallback=self._record_fallback)

    def _graph_recorder(self, recorder: Any) -> Any:
        """What records the graphs: the recorder given (tests' stand-in), CUDA graphs where the
        backend's graphs can be recorded on this device (compilation/cudagraphs.py:
        ``recording_refusal``, the rule the backend applies to each graph), or None (no graphs)."""
        if not self.cudagraphs:
            return None
        from ..compilation.cudagraphs import CUDAGraphRecorder, recording_refusal
        if recording_refusal(self._package.compiler, self.device.type == "cuda", recorder) is not None:
            return None
        return recorder if recorder is not None else CUDAGraphRecorder()

    def _precompiled_forward(self, folder: Path) -> precompiled.PrecompiledFunction:
        """The model's forward through functions saved in ``folder``, with the compiled model as
        the fallback; keyed by the backend's cache tag (a backend named by a string: the name)."""
        package = self._package
        tag = self.backend if isinstance(self.backend, str) else package.cache_tag if package is not None else None
        return precompiled.PrecompiledFunction(
            self.model.forward, name="runner", folder=folder, options_key=repr(("runner", tag)),
            compile_options={"backend": self.backend, "dynamic": True}, fallback=self._forward,
            record_fallback=self._record_fallback, loader=package.adopt_loaded if package is not None else None,
            keyable=tag is not None)

    def _record_fallback(self, reason: str) -> None:
        if self.fallbacks is not None:
            self.fallbacks.record(reason)

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _forward_step(self, meta: StepMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
                      logits_indices: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), step_context(meta), varying_sizes(), cheap_guards(), \
                recording_with(self._given_recorder):
            return self._forward(input_ids, positions, logits_indices)

    @staticmethod
    def _resolve_backend(backend: Any) -> Any:
        if backend == "fx_fastprefill":
            from ..compilation.backend import backend as make_backend
            return make_backend()
        return backend

    # ----- what the compiled model reports -------------------------------------------------------

    @property
    def report(self):
        """The latest fast-prefill report (None unless the backend is fx_fastprefill's)."""
        reports = self._package.reports if self._package is not None else None
        return reports[-1] if reports else None

    @property
    def fallbacks(self) -> FallbackCounter | None:
        """Runtime fallback counters of the fast-prefill backend, by reason."""
        return self._package.fallbacks if self._package is not None else None

    # ----- one step ------------------------------------------------------------------------------

    def step(self, chunks: Sequence[SeqChunk], logits_indices: Sequence[int] | None = None) -> torch.Tensor:
        """Run one step and return the logits rows ``[R, vocab]``.

        A chunk whose ``seq_id`` is unknown starts a new request (it gets a KV region); a known one
        continues where it stopped. ``logits_indices`` overrides the chunks' ``num_logits`` and is
        checked: in range, strictly increasing, a suffix of each request's rows.
        """
        if not chunks:
            raise ValueError("step() needs at least one chunk")
        seen = set()
        total = 0
        for chunk in chunks:
            if isinstance(chunk.seq_id, bool) or not isinstance(chunk.seq_id, int) or chunk.seq_id < 0:
                raise ValueError(f"seq_id must be a non-negative int, got {chunk.seq_id!r}")
            if chunk.seq_id in seen:
                raise ValueError(f"request {chunk.seq_id} appears twice in one step")
            seen.add(chunk.seq_id)
            if len(chunk.tokens) == 0:
                raise ValueError(f"request {chunk.seq_id}: a chunk needs at least one token")
            done = self.requests[chunk.seq_id].num_computed if chunk.seq_id in self.requests else 0
            if done + len(chunk.tokens) > self.max_model_len:
                raise ValueError(
                    f"request {chunk.seq_id}: {done} cached + {len(chunk.tokens)} new tokens exceed "
                    f"max_model_len={self.max_model_len}"
                )
            total += len(chunk.tokens)
        validate_step_tokens(chunks, self.vocab_size)
        if total > self.max_num_tokens:
            raise ValueError(f"the step has {total} tokens, more than max_num_tokens={self.max_num_tokens}")
        rows = default_logits_indices(chunks) if logits_indices is None else [int(r) for r in logits_indices]
        if logits_indices is not None:
            validate_logits_indices(rows, chunks)
        self.requests.admit_new([c.seq_id for c in chunks])
        return self._run(chunks, rows)

    def _run(self, chunks: Sequence[SeqChunk], rows: list[int]) -> torch.Tensor:
        requests = [self._padding if c.seq_id == -1 and self._padding is not None else self.requests[c.seq_id]
                    for c in chunks]
        plan = self.dispatcher.plan([len(c.tokens) for c in chunks], len(rows),
                                    has_padding_request=any(r is self._padding for r in requests))
        self.step_counts[plan.graph_mode] += 1
        if plan.graph_mode == WHOLE_STEP:
            ids, positions = step_tokens(chunks, requests)  # a few rows per request: lists are cheap here
            first_slots = [request.slot_base for chunk, request in zip(chunks, requests) for _ in chunk.tokens]
            logits = self.whole_step_graphs.run(ids.tolist(), positions.tolist(), first_slots, plan.padded_tokens)
        else:
            logits = self._run_regions(plan, chunks, requests, rows)
        for request, chunk in zip(requests, chunks):
            if request is not self._padding:  # padding rows rewrite position 0 of their own region
                request.num_computed += len(chunk.tokens)
        return logits

    def _run_regions(self, plan: StepPlan, chunks: Sequence[SeqChunk], requests: list[Request],
                     rows: list[int]) -> torch.Tensor:
        """A step through the compiled model's regions (or the model as it is), padded as planned."""
        if plan.padded_tokens > plan.num_tokens:
            chunks = list(chunks) + [SeqChunk(-1, [0] * (plan.padded_tokens - plan.num_tokens), 0)]
            requests = requests + [self._padding]
        query_start = [0]
        for chunk in chunks:
            query_start.append(query_start[-1] + len(chunk.tokens))
        meta = StepMetadata(
            query_start=query_start,
            context_lens=[r.num_computed for r in requests],
            slot_base=[r.slot_base for r in requests],
            kv_cache=self.kv_cache,
            num_logits=plan.num_logits,
            has_prefill=plan.num_logits < plan.num_tokens,
            step_id=self._next_step_id(),
            logits_rows=list(rows),
            graph_mode=plan.graph_mode,
            reduced=plan.reduced,
        )
        ids, positions = step_tokens(chunks, requests)
        input_ids, positions = to_device(ids, self.device), to_device(positions, self.device)
        indices = padded_indices(rows, plan.padded_logits, self.device, num_tokens=plan.num_tokens)
        logits = self._forward_step(meta, input_ids, positions, indices)
        # With CUDA graphs the compiled model has already copied its outputs out of graph memory.
        return logits[: len(rows)]

    def capture(self, progress: bool = True) -> float:
        """Compile and record every padded size now rather than on the first steps that need it:
        each step size of ``token_pad_sizes`` with one logits row, then each logits size of
        ``logits_pad_sizes`` (below the largest step size), then each whole-step graph size; for a
        program compiled unchanged, every (step size, logits size) pair (:meth:`_capture_sizes`).
        Returns the seconds it took."""
        if self.backend is None:
            raise ValueError("capture() needs a compiled model (backend=...)")
        if self.requests:
            raise RuntimeError(f"capture(): requests {list(self.requests)} are live; capture before serving")
        steps = self.token_pad_sizes or [max(2, self.max_num_tokens)]
        start = time.perf_counter()
        first = (steps[-1], 1)
        with declared_keys() as keys:
            self._record_size(*first)  # compiles the graph, which declares how it keys its graphs
        jobs = [first] + [job for job in self._capture_sizes(steps, GraphKeys.TOGETHER in keys) if job != first]
        for k, (num_tokens, num_logits) in enumerate(jobs):
            if k:
                self._record_size(num_tokens, num_logits)
            if progress:
                sys.stderr.write(f"\rcapturing: {k + 1}/{len(jobs)} sizes (T={num_tokens}, R={num_logits})   ")
                sys.stderr.flush()
        if self.whole_step_graphs is not None:
            if progress:
                sys.stderr.write(f"\rcapturing: whole-step graphs of {self.whole_step_sizes} rows   ")
            self.whole_step_graphs.warm_up_and_record()
        if progress:
            sys.stderr.write("\n")
        self.step_counts.clear()  # what serving runs, not the recordings
        seconds = time.perf_counter() - start
        log.info("captured %d sizes in %.1f s", len(jobs), seconds)
        return seconds

    def _record_size(self, num_tokens: int, num_logits: int) -> None:
        for _ in range(2):  # the first call of a new size warms up, the second records
            self._run([SeqChunk(-1, [0] * num_tokens, num_logits)], list(range(num_tokens - num_logits, num_tokens)))

    def _capture_sizes(self, steps: list[int], keyed_together: bool) -> list[tuple[int, int]]:
        """The (T, R) sizes to record. A cut program's graphs are keyed by T (full region) and by R
        (reduced region) apart: each T with one logits row, then each R once. A program compiled
        unchanged (``fast_prefill=False``, or a graph not cut) has one region keyed by (T, R)
        together: every pair a step can take (R a logits size up to T), or steps of an unrecorded
        pair would run without graphs while serving. The program says which (program_env.GraphKeys),
        not the backend's latest report, which may be another model's."""
        if keyed_together:
            return [(t, r) for t in reversed(steps) for r in [r for r in self.logits_pad_sizes if r <= t] or [1]]
        jobs = [(size, 1) for size in reversed(steps)]
        return jobs + [(pad_to_bucket(r + 1, steps), r) for r in reversed(self.logits_pad_sizes) if 1 < r < steps[-1]]

    def free(self, seq_id: int) -> None:
        """Release a request's KV cache region."""
        self.requests.free(seq_id)

    # ----- whole requests (runtime/scheduler.py) -------------------------------------------------

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits of the last token of each prompt, ``[len(prompts), vocab]``."""
        return Scheduler(self).prefill(prompts)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding: ``max_new_tokens`` new tokens for each prompt."""
        return Scheduler(self).generate(prompts, max_new_tokens)
