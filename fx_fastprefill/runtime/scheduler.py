"""Whole requests over a :class:`~fx_fastprefill.runtime.runner.Runner`: the Runner runs steps,
this schedules them (``Runner.prefill`` and ``Runner.generate`` go through it; a serving loop of
your own calls ``Runner.step`` and ``Runner.free`` instead, as ``benchmarks/serve.py`` does).

Each step: decode rows first, then prompts already started, then newly admitted prompts while KV
regions are free, all within the token budget (longer prompts are chunked); greedy decoding.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .batch import Request, SeqChunk, default_logits_indices, validate_tokens


class Scheduler:
    """Admits, chunks and decodes requests on one Runner (``runner``: its step API and its requests)."""

    def __init__(self, runner: Any):
        self.runner = runner

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
            if len(prompt) + max_new_tokens > self.runner.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(prompt) + max_new_tokens} positions, more than max_model_len={self.runner.max_model_len}"
                )
            validate_tokens(f"prompt {i}", list(prompt), self.runner.vocab_size)

    def schedule(self, waiting: list[Request], running: list[Request]) -> list[tuple[Request, list[int], int]]:
        """Decode rows first, then prompt chunks, then newly admitted prompts, within the budget."""
        budget = self.runner.max_num_tokens
        plan = []
        for request in running:
            if budget == 0:
                break
            if request.in_prefill:
                n = min(len(request.prompt) - request.num_computed, budget)
                tokens = request.prompt[request.num_computed: request.num_computed + n]
                reaches_end = request.num_computed + n == len(request.prompt)
                plan.append((request, tokens, 1 if reaches_end else 0))
            else:
                tokens = [request.output[-1]]
                n = 1
                plan.append((request, tokens, 1))
            budget -= n
        while waiting and budget > 0 and self.runner.requests.free_regions > 0:
            request = self.runner.requests.admit(waiting.pop(0))
            running.append(request)
            n = min(len(request.prompt), budget)
            plan.append((request, request.prompt[:n], 1 if n == len(request.prompt) else 0))
            budget -= n
        return plan

    def serve(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Request]:
        waiting = []
        for prompt in prompts:
            waiting.append(Request(self.runner.requests.new_id(), list(prompt), max_new_tokens, -1))
        finished, running = list(waiting), []
        while waiting or running:
            plan = self.schedule(waiting, running)
            chunks = [SeqChunk(r.seq_id, tokens, n) for r, tokens, n in plan]
            logits = self.runner._run(chunks, default_logits_indices(chunks))
            row = 0
            for request, _, num_logits in plan:
                if num_logits == 0:
                    continue
                request_logits = logits[row]
                row += 1
                if request.prompt_logits is None:
                    request.prompt_logits = request_logits
                if len(request.output) < request.max_new_tokens:
                    request.output.append(int(request_logits.argmax()))
            for request in [r for r in running if r.done]:
                running.remove(request)
                self.runner.free(request.seq_id)
        return finished

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits of the last token of each prompt, ``[len(prompts), vocab]``."""
        self.check_prompts(prompts, 0)
        return torch.stack([r.prompt_logits for r in self.serve(prompts, 0)])

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding: ``max_new_tokens`` new tokens for each prompt."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        self.check_prompts(prompts, max_new_tokens)
        return [r.output for r in self.serve(prompts, max_new_tokens)]
