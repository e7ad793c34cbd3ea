"""FX passes of fx_fastprefill, one per file, on the post-AOT (functional, inference) aten graph.

Run in this order by ``pipeline.py`` (``capture_sdpa`` runs earlier, on Dynamo's graph):
link_kv_sources -> eligible_layers -> (copy) -> gather_hoisting.analyze -> narrow_sliced_producers
(then analyze again) -> cut_graph -> split_regions. The compile of the regions uses split_pieces
(CUDA graphs). Their shared parts: the hoisting rules (rule_registry, hoist_rules, index_rules,
attention_rules, collective_rules, sorted_dispatch), token_layout, attention_nodes, meta_keys,
flops and fx_utils.
"""

if __name__ != "fx_fastprefill.passes":
    # From a checkout's root, ``import passes`` would load a second copy with its own rule registry.
    raise ImportError(f"the passes are the package fx_fastprefill.passes: import that (or `import fx_fastprefill`), "
                      f"not {__name__!r}")
