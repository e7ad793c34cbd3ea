"""Ranks of a tensor-parallel graph take the same cut, or none does.

A graph with torch.distributed collectives runs SPMD: each rank calls the same collectives, in the
same order, on tensors of the same sizes. A cut on one rank and not on another would pair a rank's
reduced-rows all-reduce with another's full-rows one (a hang, or sums of the wrong rows). The plan
is deterministic on identical graphs, so ranks agree whenever their graphs agree; this checks it,
once per compiled graph, in every process group the graph's collectives name, and declines the cut
on every rank when any two differ.

Invariants:
- Every rank calls :func:`agree` exactly once per compiled graph with collectives, whatever the
  pipeline decided (a decline is a plan too) and whether its program was compiled or loaded from
  the cache: the check itself is a collective, and it runs after AOTAutograd returns (no
  collective runs while compiling), so a rank with a warm cache never leaves a cold one waiting.
- What is compared is what the ranks must do alike, hashed: "unchanged", or for a cut the
  sequence of collectives and attention calls each region runs, with their shapes (R rows or T).
  Not the graph itself: a rank's share of a vocab-parallel embedding bakes its own row offsets into
  it, and Gemma 4's graph orders its nodes by a set of strings, which hashes differently in every
  process.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch.fx import GraphModule, Node

from fx_fastprefill import torch_seams
from fx_fastprefill.ops.schema import OpOverload, is_package_op
from fx_fastprefill.passes.split_regions import REDUCED

log = logging.getLogger("fx_fastprefill")
DISAGREE = "the ranks planned different cuts"
UNCHECKED = "could not check that the ranks planned the same cut"
UNCHANGED = "unchanged"  # the fingerprint of a graph compiled unchanged


def _is_collective(node: Node) -> bool:
    target = node.target
    return isinstance(target, OpOverload) and target.namespace == "_c10d_functional"


def collective_groups(gm: GraphModule) -> list[str]:
    """Names of the process groups the graph's functional collectives run in, sorted."""
    return sorted({n.args[-1] for n in gm.graph.nodes if _is_collective(n) and isinstance(n.args[-1], str)})


def _shapes(value) -> str:
    if isinstance(value, torch.Tensor):
        return str(list(value.shape))
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_shapes(v) for v in value) + ")"
    return type(value).__name__


def fingerprint(cut: GraphModule | None, declined: str, regions: dict[Node, str]) -> str:
    """A short hash of what this rank will run: "unchanged", or its cut's collectives and attention
    calls in the order the regions run them (``regions``: the pipeline's), with their shapes."""
    if declined:
        return UNCHANGED
    calls = [n for n in cut.graph.nodes if n in regions and (is_package_op(n) or _is_collective(n))]
    calls.sort(key=lambda n: regions[n] == REDUCED)  # stable: graph order within each region
    text = "\n".join(f"{regions[n]} {n.target} {_shapes(n.meta.get('val'))}" for n in calls)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def agree(groups: list[str], mine: str) -> list[str] | None:
    """Every rank's fingerprint (rank order) in the first group where they differ, else in the last
    group; None where no process group is live. Every group is asked even after a difference, so a
    rank in a later group is never left waiting."""
    import torch.distributed as dist
    if not groups or not dist.is_available() or not dist.is_initialized():
        return None
    answer: list[str] = []
    with torch_seams.no_dispatch_modes():  # real objects, not fakes, are sent
        for name in groups:
            group = torch_seams.process_group_named(name)
            gathered: list[str] = [""] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
            if not answer or all(f == answer[0] for f in answer):
                answer = gathered
    return answer


def check(groups: list[str], fingerprint: str) -> tuple[list[str], str]:
    """(each rank's fingerprint, or [] where there is nothing to check; the reason to decline, or "")."""
    try:
        ranks = agree(groups, fingerprint)
    except Exception as e:  # noqa: BLE001 - a cut the ranks could not compare is a cut not taken
        log.warning("%s; the graph is compiled unchanged", UNCHECKED, exc_info=True)
        return [], f"{UNCHECKED}: {type(e).__name__}: {e}"
    if ranks and len(set(ranks)) > 1:
        return ranks, f"{DISAGREE} (plan fingerprints by rank: {', '.join(ranks)})"
    return ranks or [], ""
