"""What the pass did to one compiled graph."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..fallbacks import FallbackCounter


@dataclass
class GatheredTensor:
    name: str          # where it comes from (module path and op)
    shape: str         # full shape -> gathered shape, in T (tokens) and R (logits rows)
    source_line: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.shape}"


@dataclass
class NarrowedTensor:
    """A tensor the regions read in disjoint slices of one dim: each region computes only its own."""
    name: str
    shape: str
    dim: int
    full: list[int]     # [start, end) read for all rows
    reduced: list[int]  # [start, end) read for the logits rows only
    source_line: str = ""

    def __str__(self) -> str:
        return (f"{self.name}: {self.shape}, dim {self.dim}: [{self.full[0]}:{self.full[1]}] for all rows, "
                f"[{self.reduced[0]}:{self.reduced[1]}] for the logits rows only")


@dataclass
class HoistStop:
    """A tensor the gather could not move past: it is gathered at the boundary instead."""
    tensor: str
    op: str
    reason: str
    source_line: str = ""
    needed_by: str = ""                      # the node that needs it with all rows
    feeds_kv_of: list[str] = field(default_factory=list)  # layers whose K/V it feeds


@dataclass
class AttentionLayerInfo:
    layer: str
    kv_source: str | None
    sliding_window: int | None
    masked: bool = False  # attends under the model's own mask (transformers models)


@dataclass
class FastPrefillReport:
    """One per compiled graph. ``cut`` is False when the graph was left unchanged (``reason`` says why)."""

    cut: bool
    reason: str = ""
    attention_layers: list[AttentionLayerInfo] = field(default_factory=list)
    eligible_layers: list[str] = field(default_factory=list)
    draft_layers: list[str] = field(default_factory=list)
    reduced_layers: list[str] = field(default_factory=list)
    # Eligible layers left on every row, each with the reason (report/builder.py: unreduced_reasons).
    unreduced: dict[str, str] = field(default_factory=dict)
    # How the logits rows are chosen: "rows by logits_indices" or "the last k rows of each sequence".
    row_selection: str = ""
    gathered: list[GatheredTensor] = field(default_factory=list)
    # Tensors split so that each region computes only the slices it reads (narrow_sliced_producers).
    narrowed: list[NarrowedTensor] = field(default_factory=list)
    stops: list[HoistStop] = field(default_factory=list)
    prompt_len: int = 0
    flops_full: float = 0.0
    flops_cut: float = 0.0
    flops_removed_fraction: float = 0.0
    fallbacks: FallbackCounter = field(default_factory=FallbackCounter)
    # Whether the regions were compiled with piecewise CUDA graphs (asked for, and on CUDA).
    cudagraphs: bool = False
    # Each rank's plan fingerprint, in rank order, where the graph has collectives and a process group
    # is live (compilation/spmd.py): equal on every rank, or the graph was left unchanged on all.
    ranks: list[str] = field(default_factory=list)
    # Seconds each pass of the pipeline took (passes/pipeline.py), in order.
    pass_seconds: dict[str, float] = field(default_factory=dict)
    # Loaded from torch's AOTAutograd cache (compilation/program_cache.py): the passes did not run in
    # this process, and the graph below is not kept.
    from_cache: bool = False
    # The cut aten graph and its region of every node, for printing (not part of the summary).
    graph: Any = field(default=None, repr=False)
    placeholder_names: dict = field(default_factory=dict, repr=False)
    rows_symbol: Any = field(default=None, repr=False)
    reduced_rows_symbol: Any = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Everything the summary and the explain command show, as plain JSON-able data."""
        return {
            "cut": self.cut,
            "reason": self.reason,
            "attention_layers": [asdict(a) for a in self.attention_layers],
            "eligible_layers": list(self.eligible_layers),
            "draft_layers": list(self.draft_layers),
            "reduced_layers": list(self.reduced_layers),
            "unreduced": dict(self.unreduced),
            "row_selection": self.row_selection,
            "gathered": [asdict(g) for g in self.gathered],
            "narrowed": [asdict(n) for n in self.narrowed],
            "stops": [asdict(s) for s in self.stops],
            "prompt_len": self.prompt_len,
            "flops_full": self.flops_full,
            "flops_cut": self.flops_cut,
            "flops_removed_fraction": self.flops_removed_fraction,
            "fallbacks": dict(self.fallbacks),
            "cudagraphs": self.cudagraphs,
            "ranks": list(self.ranks),
            "pass_seconds": dict(self.pass_seconds),
            "from_cache": self.from_cache,
        }

    def explain(self) -> str:
        """The summary, plus every layer with its K/V source and every place the hoist stopped."""
        lines = [self.summary(), "", "attention layers in graph order:"]
        reduced, eligible = set(self.reduced_layers), set(self.eligible_layers)
        for a in self.attention_layers:
            kv = f"reads the K/V of {a.kv_source}" if a.kv_source else "computes its own K/V"
            window = (f"sliding window {a.sliding_window}" if a.sliding_window else
                      "causal, under the model's attention mask" if a.masked else "full attention")
            where = "reduced (queries on R rows)" if a.layer in reduced else "full (all T rows)"
            marks = " [eligible]" if a.layer in eligible else ""
            marks += " [draft]" if a.layer in self.draft_layers else ""
            lines.append(f"  {a.layer}: {kv}, {window}; {where}{marks}")
        if self.stops:
            lines.append("where the hoist stopped (each such tensor is gathered at the boundary):")
            for s in self.stops:
                lines.append(f"  {s.tensor} ({s.op})")
                lines.append(f"      why: {s.reason}")
                if s.source_line:
                    lines.append(f"      from: {s.source_line}")
        return "\n".join(lines)

    def summary(self) -> str:
        lines = []
        if not self.cut:
            lines.append(f"not cut: {self.reason}")
        lines.append(f"attention layers: {len(self.attention_layers)}")
        sharing = [f"{a.layer} <- {a.kv_source}" for a in self.attention_layers if a.kv_source]
        lines.append(f"KV-sharing layers (reading an earlier layer's K/V): {', '.join(sharing) or 'none'}")
        lines.append(f"eligible layers (trailing KV-sharing run): {', '.join(self.eligible_layers) or 'none'}")
        lines.append(f"reduced layers (queries on logits rows): {', '.join(self.reduced_layers) or 'none'}")
        lines.extend(f"  not reduced: {layer}: {why}" for layer, why in self.unreduced.items())
        if self.row_selection:
            lines.append(f"logits rows: {self.row_selection}")
        lines.append("gathered at the boundary:")
        lines.extend(f"  {g}" for g in self.gathered)
        if self.narrowed:
            lines.append("split so that each region computes only the slices it reads:")
            lines.extend(f"  {n}" for n in self.narrowed)
        lines.append(
            f"prefill FLOPs removed at prompt length {self.prompt_len}: {100 * self.flops_removed_fraction:.1f}%"
        )
        if self.from_cache:
            lines.append("loaded from the AOTAutograd cache (compiled by an earlier process)")
        if self.cudagraphs:
            lines.append("piecewise CUDA graphs: on (attention outside, the code between captured per size)")
        if self.ranks:
            agreed = len(set(self.ranks)) == 1
            lines.append(f"ranks: {len(self.ranks)}, " + (f"same plan on every rank ({self.ranks[0]})" if agreed else
                                                           f"plans differ: {', '.join(self.ranks)}"))
        if self.fallbacks:
            lines.append("runtime fallbacks: " + ", ".join(f"{r}: {n}" for r, n in self.fallbacks.items()))
        return "\n".join(lines)


class ReportLog(list):
    """The reports of a backend, newest last; holds at most ``max_reports`` (the oldest are dropped:
    each report keeps its graph alive)."""

    def __init__(self, max_reports: int):
        super().__init__()
        self.max_reports = max_reports

    def append(self, report: FastPrefillReport) -> None:
        super().append(report)
        if len(self) > self.max_reports:
            del self[: len(self) - self.max_reports]
