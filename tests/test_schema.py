"""The argument positions the passes read (ops/schema.py) are the schemas' own."""

from fx_fastprefill.ops import schema


def _names(op) -> list[str]:
    return [argument.name for argument in op._schema.arguments]


def test_argument_positions_match_the_schemas():
    attention = _names(schema.ATTENTION_OP)
    for position, name in [(schema.Q, "q"), (schema.K, "k"), (schema.V, "v"), (schema.LAYER, "layer"),
                           (schema.KV_SOURCE, "kv_source"), (schema.SLIDING_WINDOW, "sliding_window"),
                           (schema.SCALE, "scale"), (schema.QUERY_ROWS, "query_rows"),
                           (schema.KV_WRITTEN, "kv_written")]:
        assert attention[position] == name
    write = _names(schema.WRITE_KV_OP)
    assert [write[schema.WRITE_K], write[schema.WRITE_V], write[schema.WRITE_LAYER]] == ["k", "v", "layer"]
    sdpa = _names(schema.SDPA_OP)
    expected = ["q", "k", "v", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "layer", "query_suffix"]
    positions = [schema.SDPA_Q, schema.SDPA_K, schema.SDPA_V, schema.SDPA_MASK, schema.SDPA_DROPOUT,
                 schema.SDPA_IS_CAUSAL, schema.SDPA_SCALE, schema.SDPA_GQA, schema.SDPA_LAYER,
                 schema.SDPA_QUERY_SUFFIX]
    assert [sdpa[p] for p in positions] == expected
    assert sdpa[len(expected):] == ["causal_queries"]  # the keyword the sdpa rule writes
