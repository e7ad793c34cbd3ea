"""passes/hoist_rules.py, rule by rule, on small traced graphs: which rows of which inputs each op
needs for rows of its output, and where it must stop. A failing row names the rule."""

from __future__ import annotations

import operator

import pytest
import sympy
import torch
import torch.nn.functional as F

from fx_fastprefill.ops import attention, sdpa  # noqa: F401  (the ops' kernels and fake kernels)
from fx_fastprefill.ops.schema import ATTENTION_OP, SDPA_OP
from fx_fastprefill.passes.hoist_rules import REDUCED_SIZE, RuleResult, lookup_rule
from fx_fastprefill.passes.token_layout import Layout
from tests.helpers import first, rows_of, trace

aten = torch.ops.aten
c10d = torch.ops._c10d_functional  # traced on their fake kernels: no process group needed
T, D, H, W = 7, 5, 3, 4  # distinct sizes: the symbols stay distinct
ids = torch.int64

# (name, fn, input shapes, input dtypes or None, op, output layout axis,
#  expected: {input position: layout axis of its rows, or None when needed whole} or a reason substring)
CASES = [
    ("all_reduce", lambda x: c10d.all_reduce(x, "sum", "tp"), [(T, D)], None, c10d.all_reduce.default, 0, {0: 0}),
    ("wait_tensor", lambda x: c10d.wait_tensor(x), [(T, D)], None, c10d.wait_tensor.default, 0, {0: 0}),
    ("broadcast", lambda x: c10d.broadcast(x, 0, "tp"), [(T, D)], None, c10d.broadcast.default, 0, {0: 0}),
    ("all_gather off the token dim", lambda x: c10d.all_gather_into_tensor(x, 2, "tp"), [(H, T, D)], None,
     c10d.all_gather_into_tensor.default, 1, {0: 1}),
    ("all_gather over the token dim", lambda x: c10d.all_gather_into_tensor(x, 2, "tp"), [(T, D)], None,
     c10d.all_gather_into_tensor.default, 0, "sequence parallelism"),
    ("reduce_scatter off the token dim", lambda x: c10d.reduce_scatter_tensor(x, "sum", 2, "tp"), [(2 * H, T, D)],
     None, c10d.reduce_scatter_tensor.default, 1, {0: 1}),
    ("reduce_scatter over the token dim", lambda x: c10d.reduce_scatter_tensor(x, "sum", 2, "tp"), [(T, D)], None,
     c10d.reduce_scatter_tensor.default, 0, "sequence parallelism"),
    ("pointwise", lambda x, y: x * y, [(T, D), (T, D)], None, aten.mul.Tensor, 0, {0: 0, 1: 0}),
    ("pointwise broadcast", lambda x, b: x + b, [(T, D), (D,)], None, aten.add.Tensor, 0, {0: 0, 1: None}),
    ("pointwise size-1 rows", lambda x, b: x + b, [(T, D), (1, D)], None, aten.add.Tensor, 0, {0: 0, 1: None}),
    ("mm rows", lambda x, w: x @ w, [(T, D), (D, H)], None, aten.mm.default, 0, {0: 0, 1: None}),
    ("mm columns", lambda w, x: w @ x, [(H, D), (D, T)], None, aten.mm.default, 1, {0: None, 1: 1}),
    (
        "addmm",
        lambda b, x, w: torch.addmm(b, x, w),
        [(H,), (T, D), (D, H)],
        None,
        aten.addmm.default,
        0,
        {0: None, 1: 0, 2: None},
    ),
    ("bmm batch", lambda x, y: torch.bmm(x, y), [(T, D, H), (T, H, W)], None, aten.bmm.default, 0, {0: 0, 1: 0}),
    ("bmm rows", lambda x, y: torch.bmm(x, y), [(H, T, D), (H, D, W)], None, aten.bmm.default, 1, {0: 1, 1: None}),
    ("view merge trailing", lambda x: x.view(-1, H * D), [(T, H, D)], None, aten.view.default, 0, {0: 0}),
    (
        "view splits rows",
        lambda x: x.view(H, -1),
        [(T * H, D)],
        None,
        aten.view.default,
        1,
        "splits or merges the token dim",
    ),
    ("expand", lambda x: x.expand(-1, H, D), [(T, 1, D)], None, aten.expand.default, 0, {0: 0}),
    (  # Dynamo specializes the row count to the constant: a static graph, its token-dim size rewritten
        "expand to a constant row count",
        lambda x: x.expand(T, H, D),
        [(T, 1, D)],
        None,
        aten.expand.default,
        0,
        {0: 0},
    ),
    # one row broadcast over the token dim (a sink logit over the queries): the source whole
    ("expand broadcasts one row", lambda x, y: x.expand_as(y), [(1, D), (T, D)], None, aten.expand.default, 0,
     {0: None}),
    ("expand creates the token dim", lambda x, y: x.expand_as(y), [(D,), (T, D)], None, aten.expand.default, 0,
     "creates the token dim"),
    ("gather off the token dim", lambda x, i: x.gather(1, i), [(T, D), (T, H)], [torch.float32, ids],
     aten.gather.default, 0, {0: 0, 2: 0}),
    ("gather along the token dim", lambda x, i: x.gather(0, i), [(T, D), (T, D)], [torch.float32, ids],
     aten.gather.default, 0, "gather along the token dim"),
    ("scatter off the token dim", lambda x, i, v: x.scatter(1, i, v), [(T, D), (T, H), (T, H)],
     [torch.float32, ids, torch.float32], aten.scatter.src, 0, {0: 0, 2: 0, 3: 0}),
    ("scatter of a value", lambda x, i: x.scatter(1, i, 1.0), [(T, D), (T, H)], [torch.float32, ids],
     aten.scatter.value, 0, {0: 0, 2: 0}),
    ("scatter along the token dim", lambda x, i: x.scatter(0, i, 1.0), [(T, D), (T, D)], [torch.float32, ids],
     aten.scatter.value, 0, "scatter along the token dim"),
    ("max over the last dim", lambda x: x.max(-1, keepdim=True)[0], [(T, D)], None, aten.max.dim, 0, {0: 0}),
    ("max over the token dim", lambda x: x.max(0, keepdim=True)[0], [(T, D)], None, aten.max.dim, 0,
     "a reduction over the token dim"),
    ("baddbmm query rows", lambda b, x, y: torch.baddbmm(b, x, y), [(H, 1, T), (H, T, D), (H, D, T)], None,
     aten.baddbmm.default, 1, {0: None, 1: 1, 2: None}),
    ("repeat off rows", lambda x: x.repeat(1, 2), [(T, D)], None, aten.repeat.default, 0, {0: 0}),
    ("repeat rows", lambda x: x.repeat(2, 1), [(T, D)], None, aten.repeat.default, 0, "repeat along the token dim"),
    ("permute", lambda x: x.permute(1, 0, 2), [(T, H, D)], None, aten.permute.default, 1, {0: 0}),
    ("transpose", lambda x: x.transpose(0, 1), [(T, D)], None, aten.transpose.int, 1, {0: 0}),
    ("unsqueeze", lambda x: x.unsqueeze(0), [(T, D)], None, aten.unsqueeze.default, 1, {0: 0}),
    (
        "unsqueeze at rows",
        lambda x: x.unsqueeze(0),
        [(T, D)],
        None,
        aten.unsqueeze.default,
        0,
        "unsqueeze at the token dim",
    ),
    ("squeeze", lambda x: x.squeeze(1), [(T, 1, D)], None, aten.squeeze.dim, 0, {0: 0}),
    ("select", lambda x: x[:, 1], [(T, H, D)], None, aten.select.int, 0, {0: 0}),
    ("slice off rows", lambda x: x[:, 1:3], [(T, D)], None, aten.slice.Tensor, 0, {0: 0}),
    ("slice of rows", lambda x: x[1:], [(T, D)], None, aten.slice.Tensor, 0, "a slice of the token dim"),
    (
        "cat off rows",
        lambda x, y: torch.cat([x, y], 1),
        [(T, D), (T, H)],
        None,
        aten.cat.default,
        0,
        {(0, 0): 0, (0, 1): 0},
    ),
    (
        "cat along rows",
        lambda x, y: torch.cat([x, y]),
        [(T, D), (H, D)],
        None,
        aten.cat.default,
        0,
        "cat along the token dim",
    ),
    ("mean off rows", lambda x: x.mean(-1), [(T, D)], None, aten.mean.dim, 0, {0: 0}),
    (
        "sum over rows",
        lambda x: x.sum(0, keepdim=True),
        [(T, D)],
        None,
        aten.sum.dim_IntList,
        0,
        "a reduction over the token dim",
    ),
    ("var", lambda x: torch.var(x, -1, keepdim=True), [(T, D)], None, aten.var.correction, 0, {0: 0}),
    ("softmax", lambda x: x.softmax(-1), [(T, D)], None, aten._softmax.default, 0, {0: 0}),
    (
        "softmax over rows",
        lambda x: x.softmax(0),
        [(T, D)],
        None,
        aten._softmax.default,
        0,
        "softmax over the token dim",
    ),
    (
        "embedding",
        lambda w, i: F.embedding(i, w),
        [(W * H, D), (T,)],
        [torch.float32, ids],
        aten.embedding.default,
        0,
        {0: None, 1: 0},
    ),
    (
        "index_select off rows",
        lambda x, i: x.index_select(1, i),
        [(T, D), (H,)],
        [torch.float32, ids],
        aten.index_select.default,
        0,
        {0: 0, 2: None},
    ),
    ("split", lambda x: x.split(2, -1)[0], [(T, D)], None, aten.split.Tensor, 0, {0: 0}),
    ("getitem", lambda x: x.split(2, -1)[0], [(T, D)], None, operator.getitem, 0, {0: 0}),
    (
        "layer norm",
        lambda x, w, b: F.layer_norm(x, (D,), w, b),
        [(T, D), (D,), (D,)],
        None,
        aten.native_layer_norm.default,
        0,
        {0: 0, 2: None, 3: None},
    ),
    ("no rule", lambda x: x.cumsum(0), [(T, D)], None, aten.cumsum.default, 0, "no hoisting rule for aten.cumsum"),
]


def apply_rule(fn, shapes, dtypes, target, axis) -> RuleResult | str:
    gm = trace(fn, *shapes, dtypes=dtypes)
    node = first(gm, target)
    rule = lookup_rule(node)
    if rule is None:
        return f"no hoisting rule for {node.target}"
    rows_input = next(i for i, s in enumerate(shapes) if T in s or T * H in s)  # the first input with rows
    dim = list(shapes[rows_input]).index(T) if T in shapes[rows_input] else 0
    return rule(node, Layout(axis), rows_of(gm, rows_input, dim))


def positions(node, result: RuleResult) -> dict:
    """{argument position: requested layout axis or None} of a rule's requirements."""
    return {(req.path[1] if len(req.path) == 2 else req.path[1:]): (None if req.layout is None else req.layout.axis)
            for req in result.requirements}


@pytest.mark.parametrize("name, fn, shapes, dtypes, target, axis, expected", CASES, ids=[c[0] for c in CASES])
def test_rule(name, fn, shapes, dtypes, target, axis, expected):
    result = apply_rule(fn, shapes, dtypes, target, axis)
    if isinstance(expected, str):
        assert isinstance(result, str) and expected in result, result
    else:
        assert isinstance(result, RuleResult), result
        assert positions(None, result) == expected


def test_expand_of_one_row_is_resized_to_the_reduced_rows():
    gm = trace(lambda x, y: x.expand_as(y), (1, D), (T, D))
    node = first(gm, aten.expand.default)
    assert lookup_rule(node)(node, Layout(0), rows_of(gm, 1)).arg_rewrites == {("args", 1, 0): REDUCED_SIZE}


def test_repeat_along_the_token_dim_read_as_copies():
    """``x.repeat(E, 1)`` gives every expert all rows; read as ``[E, T, D]`` the rows asked for are
    in E groups, which are the source's plain rows. Read as one dim of E*T rows, it stops."""
    E = 2
    gm = trace(lambda x: x.repeat(E, 1), (T, D))
    node = first(gm, aten.repeat.default)
    rows = rows_of(gm)
    [req] = lookup_rule(node)(node, Layout(0, outer=sympy.Integer(E)), rows).requirements
    assert req.layout == Layout(0)
    assert "copies are not read apart" in lookup_rule(node)(node, Layout(0), rows)


def test_view_sizes_on_the_token_dim_are_rewritten_in_the_reduced_rows():
    gm = trace(lambda x: x.view(x.shape[0], H * D), (T, H, D))
    node = first(gm, aten.view.default)
    result = lookup_rule(node)(node, Layout(0), rows_of(gm))
    assert result.arg_rewrites == {("args", 1, 0): REDUCED_SIZE}


def test_a_view_that_merges_rows_with_trailing_dims_maps_to_blocks():
    gm = trace(lambda x: x.reshape(-1, D), (T, H, D))  # [T, H, D] -> [T*H, D]: rows in blocks of H
    node = first(gm, aten.view.default)
    [req] = lookup_rule(node)(node, Layout(0, inner=rows_of(gm, 0, 1)), rows_of(gm)).requirements
    assert req.layout.axis == 0 and req.layout.plain


def test_sdpa_queries_are_rows_keys_are_whole():
    def fn(q, k, v):
        return torch.ops.fx_fastprefill.sdpa(q, k, v, None, 0.0, True, None, False, "layer", False)
    gm = trace(fn, (2, H, T, D), (2, H, T, D), (2, H, T, D))
    node = first(gm, SDPA_OP)
    result = lookup_rule(node)(node, Layout(2), rows_of(gm, 0, 2))
    assert positions(node, result) == {0: 2, 1: None, 2: None}
    assert result.arg_rewrites == {("args", 9): True}  # the query-suffix form


def test_attention_op_rows_and_its_kv_needed_whole():
    def fn(q, k, v):
        token = torch.ops.fx_fastprefill.write_kv(k, v, "a")
        return torch.ops.fx_fastprefill.attention(q, k, v, "a", None, None, None, None, token)
    gm = trace(fn, (T, 4, 8), (T, 2, 8), (T, 2, 8))
    node = first(gm, ATTENTION_OP)
    result = lookup_rule(node)(node, Layout(0), rows_of(gm))
    assert positions(node, result) == {0: 0, 1: None, 2: None, 8: None} and result.set_query_rows
    assert "merged with another dim" in lookup_rule(node)(node, Layout(0, inner=rows_of(gm, 0, 1)), rows_of(gm))
