"""passes/token_layout.py: where the token rows go through a view, table-driven."""

import pytest
import sympy

from fx_fastprefill.passes.token_layout import Layout, map_view_layout

T, B, S = sympy.symbols("T B S", positive=True, integer=True)
I = sympy.Integer

# (name, source shape, source layout, destination shape, rows symbol, expected layout or None)
CASES = [
    ("identity", [T, I(8)], Layout(0), [T, I(8)], T, Layout(0)),
    ("split trailing dim", [T, I(8)], Layout(0), [T, I(2), I(4)], T, Layout(0)),
    ("merge trailing dims: rows in blocks", [T, I(2), I(4)], Layout(0), [T * 8], T, Layout(0, inner=I(8))),
    ("unmerge blocks", [T * 8], Layout(0, inner=I(8)), [T, I(8)], T, Layout(0)),
    ("merge a batch dim before", [B, S, I(4)], Layout(1), [B * S, I(4)], S, Layout(0, outer=B)),
    ("rows of a merged batch back", [B * S, I(4)], Layout(0, outer=B), [B, S, I(4)], S, Layout(1)),
    ("leading unit dim", [T, I(4)], Layout(0), [I(1), T, I(4)], T, Layout(1)),
    ("split the row count itself", [T * 2, I(4)], Layout(0), [T, I(2), I(4)], T, None),
    ("a second dim of T rows (keys): found by position", [T, T], Layout(0), [T, T], T, Layout(0)),
    ("rows gone", [T, I(4)], Layout(0), [T * 4], S, None),
    # Static shapes: the row count is a number; the dim is found by position, not by an equal size.
    ("static: merge a batch dim before", [I(2), I(8), I(8)], Layout(1), [I(16), I(8)], I(8), Layout(0, outer=I(2))),
    ("static: split trailing, sizes collide", [I(8), I(8)], Layout(0), [I(8), I(2), I(4)], I(8), Layout(0)),
    ("static: trailing dim equal to rows", [I(2), I(8), I(8)], Layout(1), [I(2), I(8), I(8)], I(8), Layout(1)),
    ("static: merge trailing dims", [I(8), I(8)], Layout(0), [I(64)], I(8), Layout(0, inner=I(8))),
    ("static: unit dims around", [I(8), I(4)], Layout(0), [I(1), I(8), I(1), I(4)], I(8), Layout(1)),
    ("static: split the row count", [I(8), I(4)], Layout(0), [I(4), I(2), I(4)], I(8), None),
]


@pytest.mark.parametrize("name, src_shape, src, dst_shape, rows, expected", CASES, ids=[c[0] for c in CASES])
def test_map_view_layout(name, src_shape, src, dst_shape, rows, expected):
    assert map_view_layout(src_shape, src, dst_shape, rows) == expected


def test_layout_text():
    assert str(Layout(1, inner=I(4), outer=B)) == "dim 1 (blocks of 4) (B sequences)"
    assert Layout(0).plain and not Layout(0, inner=I(2)).plain
