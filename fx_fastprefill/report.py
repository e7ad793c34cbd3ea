"""What the pass did to one compiled graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .fallbacks import FallbackCounter


@dataclass
class GatheredTensor:
    name: str          # where it comes from (module path and op)
    shape: str         # full shape -> gathered shape, in T (tokens) and R (logits rows)
    source_line: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.shape}"


@dataclass
class HoistStop:
    tensor: str
    op: str
    reason: str
    source_line: str = ""


@dataclass
class AttentionLayerInfo:
    layer: str
    kv_source: str | None
    sliding_window: int | None


@dataclass
class FastPrefillReport:
    """One per compiled graph. ``cut`` is False when the graph was left unchanged (``reason`` says why)."""

    cut: bool
    reason: str = ""
    attention_layers: list[AttentionLayerInfo] = field(default_factory=list)
    eligible_layers: list[str] = field(default_factory=list)
    draft_layers: list[str] = field(default_factory=list)
    reduced_layers: list[str] = field(default_factory=list)
    gathered: list[GatheredTensor] = field(default_factory=list)
    stops: list[HoistStop] = field(default_factory=list)
    prompt_len: int = 0
    flops_full: float = 0.0
    flops_cut: float = 0.0
    flops_removed_fraction: float = 0.0
    fallbacks: FallbackCounter = field(default_factory=FallbackCounter)
    # The cut aten graph and its region of every node, for printing (not part of the summary).
    graph: Any = field(default=None, repr=False)
    placeholder_names: dict = field(default_factory=dict, repr=False)
    rows_symbol: Any = field(default=None, repr=False)
    reduced_rows_symbol: Any = field(default=None, repr=False)

    def summary(self) -> str:
        lines = []
        if not self.cut:
            lines.append(f"not cut: {self.reason}")
        lines.append(f"attention layers: {len(self.attention_layers)}")
        lines.append(f"eligible layers (trailing KV-sharing run): {', '.join(self.eligible_layers) or 'none'}")
        lines.append(f"reduced layers (queries on logits rows): {', '.join(self.reduced_layers) or 'none'}")
        lines.append("gathered at the boundary:")
        lines.extend(f"  {g}" for g in self.gathered)
        lines.append(f"prefill FLOPs removed at prompt length {self.prompt_len}: {100 * self.flops_removed_fraction:.1f}%")
        if self.fallbacks:
            lines.append("runtime fallbacks: " + ", ".join(f"{r}: {n}" for r, n in self.fallbacks.items()))
        return "\n".join(lines)
