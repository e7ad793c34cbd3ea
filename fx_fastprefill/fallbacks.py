"""Counting and logging every time a step leaves the fast path, with its reason.

A fallback is never silent: the first occurrence of each reason is logged at INFO on the
``fx_fastprefill`` logger, later ones at DEBUG, and every occurrence is counted.
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("fx_fastprefill")

# The reasons a step runs the full-rows path (or skips the reduced region).
NO_STEP_METADATA = "no step metadata (capture, dummy batch or a call outside the Runner)"
PURE_DECODE = "pure decode batch (every row needs logits)"
NOT_SMALLER = "padded logits rows are not fewer than the tokens"
NO_LOGITS_ROWS = "no logits rows in this step (R == 0): reduced region skipped"
# Compile-time: a pass or the regions' compile failed; the graph was compiled unchanged (the report says why).
PASS_FAILED = "the pass failed on this graph: compiled unchanged"
# Compile-time: autograd differentiates the graph; compiled the standard way (the report says why).
AUTOGRAD = "autograd is on: the graph was compiled the standard way, uncut"
# Compile-time: the ranks of a tensor-parallel graph planned different cuts, or could not compare
# them (compilation/spmd.py).
RANKS_DISAGREE = "the ranks did not agree on one cut: compiled unchanged"
# Compile-time: the compiled program is not stored in (or served from) torch's AOTAutograd cache:
# this torch lacks the API, or a pass of the pipeline has no readable source to key it by.
NO_PROGRAM_CACHE = ("the compiled program cannot be cached (torch API missing, or a pass without source): "
                    "compiled uncached")
# Compile-time: the compiled program did not pickle, so the AOTAutograd cache holds nothing for it and the
# next process compiles it again (the warning names the part that does not pickle).
PROGRAM_NOT_SAVED = "the compiled program could not be saved in the AOTAutograd cache: the next process compiles it"
# Load-time: a compiled program in the AOTAutograd cache whose bytes do not match their checksum (a damaged
# entry): not loaded, the program is compiled again in this process.
PROGRAM_DAMAGED = ("a compiled program in the AOTAutograd cache is damaged (its checksum does not match): not "
                   "loaded, compiled again")
# Compile- or load-time: a file of Inductor's cache (a compiled graph's .py, a kernel's .so) did not load:
# deleted and made again (compilation/damaged_files.py).
COMPILED_FILE_DAMAGED = "a file of Inductor's cache did not load (damaged): deleted and made again"
# Compile-time, compile_for_generate(precompile=...) and Runner(precompile=...): a path saved and loaded whole
# (compilation/precompiled.py).
PRECOMPILE_UNAVAILABLE = ("precompiling asked for, but this torch has no aot_compile, the backend's program cannot "
                          "be keyed or the model runs on several ranks: the path compiles through torch.compile")
PRECOMPILE_FAILED = ("precompiling a path failed (a graph break, or its compile could not be saved): it compiles "
                     "through torch.compile from now on (a function compiled but not saved still serves its calls)")
PRECOMPILED_LOAD_FAILED = "a saved precompiled function could not be loaded: skipped"
PRECOMPILED_STALE = ("a saved precompiled function was traced from source files that have changed since it was "
                     "saved: skipped (another is compiled for the code as it is now)")
PRECOMPILE_FOLDER_FAILED = ("a file of the precompile folder could not be read or written (a read-only folder, a file "
                            "in its place): this process runs without it")
# Compile_for_generate: the static cache's K/V shapes could not be probed (K and V of different shapes,
# as in an MLA latent cache, or the probe failed): the cache is made inside the compiled prefill.
STATIC_CACHE_IN_PREFILL = ("the static cache's K/V shapes are not known before the prefill: its tensors are made "
                           "inside the compiled prefill, and decode CUDA graphs may copy them every step")
PRECOMPILED_GUARD_MISS = "no saved precompiled function's guards pass for this call: another one is compiled and saved"
# Compile-time: piecewise CUDA graphs were asked for but cannot be used for this graph.
CUDAGRAPHS_NOT_CUDA = "CUDA graphs asked for, but the graph's inputs are not on a CUDA device: compiled without them"
CUDAGRAPHS_NEED_INDUCTOR = ("CUDA graphs asked for with compiler='eager': they record Inductor's pieces only (a test's "
                            "stand-in recorder excepted): compiled without them")
# Run-time, per region call with piecewise CUDA graphs.
CUDAGRAPH_WARMUP = (
    "first call of these sizes: the region runs without CUDA graphs (warm-up; the next call records them)"
)
CUDAGRAPH_RECORD_FAILED = "recording the region's CUDA graphs failed for these sizes: they run without graphs"
CUDAGRAPH_STATIC_INPUT_MOVED = (
    "a parameter or buffer moved since the CUDA graphs were recorded: they are recorded again"
)

# Run-time, per step that could run as a whole-step CUDA graph (runtime/whole_step_graphs.py) but did not.
WHOLE_STEP_WARMUP = "first step of this size: run without its whole-step CUDA graph (warm-up; the next one records)"
WHOLE_STEP_RECORD_FAILED = "recording the whole-step CUDA graph of this size failed: its steps run piecewise"
WHOLE_STEP_TOO_LARGE = "more rows than the largest whole-step CUDA graph: the step runs piecewise"


class FallbackCounter(Counter):
    """Occurrences by reason; logs each reason once."""

    def record(self, reason: str) -> None:
        if reason not in self:
            log.info("fallback: %s (logged once; counted in .fallbacks)", reason)
        else:
            log.debug("fallback: %s (%d times so far)", reason, self[reason] + 1)
        self[reason] += 1
