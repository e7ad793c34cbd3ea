"""Make the KV cache explicit in the graph: writes are nodes, reads depend on them.

Model code calls the attention op, which writes its own cache, and a sharing layer calls it with
``k=None, v=None, kv_source=name``: nothing in the graph would order the sharing read after the
source's write, and a write hidden in an attention call would be lost if that call were skipped.
This pass
- splits every cache write out into a ``write_kv(k, v, layer)`` node just before its attention
  call; the attention call takes the node's token (``kv_written``) and no longer writes;
- passes the source's own K/V nodes and write token to every sharing call, so it reads this step's
  keys through the dataflow and earlier steps' keys from the cache, whatever order the compiler
  picks.

Invariants:
- Every ``kv_source`` names an earlier attention node that computes its own K/V; otherwise a
  ValueError names the layer and what is wrong.
- A sharing layer's query layout must fit its source (same head dim, query heads a multiple of the
  source's KV heads).
- Only the k/v arguments of sharing calls change; sdpa nodes (transformers models) are not touched.
"""

from __future__ import annotations

from torch.fx import GraphModule

from fx_fastprefill.ops.schema import ATTENTION_OP, K, KV_WRITTEN, V, WRITE_KV_OP

from .attention_nodes import AttentionNode, find_attention_nodes


def link_kv_sources(gm: GraphModule) -> list[AttentionNode]:
    layers = find_attention_nodes(gm.graph)
    by_name: dict[str, list[AttentionNode]] = {}
    for attn in layers:
        by_name.setdefault(attn.layer, []).append(attn)
    seen: dict[str, AttentionNode] = {}
    for attn in layers:
        if attn.node.target is not ATTENTION_OP:
            continue  # sdpa: K/V are plain dataflow already, and there is no cache to write
        if attn.shares_kv:
            source = seen.get(attn.kv_source)
            if source is None:
                if attn.kv_source in by_name:
                    raise ValueError(
                        f"attention layer {attn.layer!r} reads kv_source={attn.kv_source!r}, which runs later in the "
                        "graph: a KV-sharing layer must come after the layer whose cache it reads"
                    )
                known = ", ".join(a.layer for a in layers if not a.shares_kv) or "none"
                raise ValueError(
                    f"attention layer {attn.layer!r} names kv_source={attn.kv_source!r}, but the graph has no "
                    "attention "
                    f"layer of that name (layers with their own K/V: {known})"
                )
            if source.shares_kv:
                raise ValueError(
                    f"attention layer {attn.layer!r} reads kv_source={attn.kv_source!r}, which itself shares the cache "
                    f"of {source.kv_source!r}: name the layer that owns the cache"
                )
            k, v = source.node.args[K], source.node.args[V]
            q_val, k_val = attn.node.args[0].meta["val"], k.meta["val"]
            if q_val.shape[2] != k_val.shape[2] or q_val.shape[1] % k_val.shape[1] != 0:
                raise ValueError(
                    f"attention layer {attn.layer!r} has queries of {q_val.shape[1]} heads x {q_val.shape[2]}, which "
                    "do "
                    f"not fit the K/V of its kv_source {attn.kv_source!r} ({k_val.shape[1]} heads x {k_val.shape[2]})"
                )
            args = list(attn.node.args)
            args[K], args[V], args[KV_WRITTEN] = k, v, source.node.args[KV_WRITTEN]
            attn.node.args = tuple(args)
        elif attn.layer in seen:
            raise ValueError(f"two attention calls are named layer={attn.layer!r}; layer names must be unique")
        elif attn.node.args[KV_WRITTEN] is None:
            with gm.graph.inserting_before(attn.node):
                token = gm.graph.call_function(WRITE_KV_OP, (attn.node.args[K], attn.node.args[V], attn.layer))
            token.meta["val"] = attn.node.args[K].meta["val"].new_empty(0)
            token.meta["stack_trace"] = attn.node.meta.get("stack_trace")
            token.meta["nn_module_stack"] = attn.node.meta.get("nn_module_stack")
            args = list(attn.node.args)
            args[KV_WRITTEN] = token
            attn.node.args = tuple(args)
        seen[attn.layer] = attn
    gm.recompile()
    return layers
