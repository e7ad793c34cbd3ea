"""The package's custom ops as the passes see them: schemas, op handles, argument positions.

Defining the schemas here, apart from their kernels (``ops/attention.py``, ``ops/sdpa.py``), lets
the passes match and rewrite the ops without importing Triton or any kernel. The ops are opaque
to the compiler on purpose: the passes find them by handle and read their arguments by position.

Invariants:
- Importing this module defines the three ops once per process; their kernels and fake
  implementations are registered by the modules that implement them (imported by the package).
- Argument positions below match the schemas exactly (a test checks them against the schemas).
"""

from __future__ import annotations

import torch
from torch.fx import Node

NAMESPACE = "fx_fastprefill"
# The class of an aten or custom op overload (an FX node's target with a schema), read off a public
# op rather than imported from the private module that defines it.
OpOverload = type(torch.ops.aten.mm.default)

_SCHEMAS = {
    "attention": "(Tensor q, Tensor? k, Tensor? v, str layer, str? kv_source, SymInt? sliding_window, "
                 "float? scale, Tensor? query_rows, Tensor? kv_written) -> Tensor",
    "write_kv": "(Tensor k, Tensor v, str layer) -> Tensor",
    "sdpa": "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool is_causal, float? scale, "
            "bool enable_gqa, str layer, bool query_suffix, SymInt? causal_queries=None) -> Tensor",
}

_library = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in _SCHEMAS.items():
    _library.define(_name + _schema, tags=(torch.Tag.pt2_compliant_tag,))

ATTENTION_OP = torch.ops.fx_fastprefill.attention.default
WRITE_KV_OP = torch.ops.fx_fastprefill.write_kv.default
SDPA_OP = torch.ops.fx_fastprefill.sdpa.default

# Argument positions of the attention op.
Q, K, V, LAYER, KV_SOURCE, SLIDING_WINDOW, SCALE, QUERY_ROWS, KV_WRITTEN = range(9)
# Argument positions of the write_kv op.
WRITE_K, WRITE_V, WRITE_LAYER = range(3)
# Argument positions of the sdpa op.
SDPA_Q, SDPA_K, SDPA_V, SDPA_MASK, SDPA_DROPOUT, SDPA_IS_CAUSAL, SDPA_SCALE, SDPA_GQA, SDPA_LAYER, SDPA_QUERY_SUFFIX = (
    range(10)
)  # and the keyword causal_queries


def is_package_op(node: Node) -> bool:
    """A call of one of this package's ops (they read per-step host metadata: never inside a CUDA graph)."""
    target = node.target
    return node.op == "call_function" and isinstance(target, OpOverload) and target.namespace == NAMESPACE
