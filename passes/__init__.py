"""FX passes of fx_fastprefill, on the post-AOT (functional, inference) aten graph.

Order: find attention nodes -> link KV sources (explicit K/V edges) -> eligible layers (report) ->
gather hoisting (analysis) -> cut (rewrite) -> split into regions.
"""
