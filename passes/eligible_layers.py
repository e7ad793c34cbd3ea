"""The seed's eligible layers: the trailing contiguous run of KV-sharing attention layers.

Scanning from the last attention layer backwards, sharing layers join the run and the first
non-sharing layer ends it. Draft layers (a speculator's, appended after the target model) are
skipped: they neither join nor end the run. Graph order is execution order, so this is exact.
"""

from __future__ import annotations

from typing import Iterable

from .attention_nodes import AttentionNode


def eligible_layers(layers: list[AttentionNode], draft_layers: Iterable[str] = (), enabled: bool = True) -> list[str]:
    if not enabled:
        return []
    drafts = set(draft_layers)
    run: list[str] = []
    for attn in reversed(layers):
        if attn.layer in drafts:
            continue
        if not attn.shares_kv:
            break
        run.append(attn.layer)
    return run[::-1]
