"""The names the passes leave on nodes (``node.meta``) for later passes and the report: one
spelling, here.

- ``ROLE``: what a node the cut inserted is for: ``BOUNDARY_GATHER`` (a gather of a boundary
  tensor, or a view around it: it opens the reduced region), ``REDUCED_SIZE_NODE`` (a size computed
  from the logits rows: it belongs to the reduced region), ``FULL_SIZE_NODE`` (a size of the full
  graph that an op of the reduced region reads, such as a query count).
- ``SOURCE`` / ``LAYOUT``: on a boundary gather, the tensor it gathers and the layout it gathers on.
"""

ROLE = "ffp_role"
SOURCE = "ffp_source"
LAYOUT = "ffp_layout"

BOUNDARY_GATHER = "boundary_gather"
REDUCED_SIZE_NODE = "reduced_size_node"
FULL_SIZE_NODE = "full_size_node"
