"""Where the token rows live in a tensor, and how that place moves through views.

Invariants:
- A layout ``(axis, inner)`` says dimension ``axis`` has size ``rows * inner`` and element ``i``
  of that dimension belongs to row ``i // inner``. Plain row-aligned tensors have ``inner == 1``;
  ``inner > 1`` appears when a view merges the token dim with the dims after it.
- Sizes are sympy expressions; the row count is one free symbol (``T`` in the full graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import sympy
import torch


@dataclass(frozen=True)
class Layout:
    axis: int
    inner: sympy.Expr = sympy.Integer(1)

    def __str__(self) -> str:
        return f"dim {self.axis}" + ("" if self.inner == 1 else f" (blocks of {self.inner})")


def size_expr(value) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(int(value))


def shape_exprs(val) -> list[sympy.Expr] | None:
    if not isinstance(val, torch.Tensor):
        return None
    return [size_expr(s) for s in val.shape]


def rows_factor(size: sympy.Expr, rows: sympy.Symbol) -> sympy.Expr | None:
    """``inner`` when ``size == rows * inner`` with ``inner`` free of ``rows``; else None."""
    if rows not in size.free_symbols:
        return None
    inner = sympy.simplify(size / rows)
    if rows in inner.free_symbols or inner.is_number and (inner <= 0 or not inner.is_integer):
        return None
    return inner


def _prod(values: Sequence[sympy.Expr]) -> sympy.Expr:
    out = sympy.Integer(1)
    for v in values:
        out = out * v
    return out


def map_view_layout(src_shape: Sequence[sympy.Expr], src: Layout, dst_shape: Sequence[sympy.Expr],
                    rows: sympy.Symbol) -> Layout | None:
    """The layout of the rows after viewing a row-major tensor of ``src_shape`` as ``dst_shape``.

    Rows stay addressable when the outer product before the token dim and the contiguous block of
    each row are preserved; a view that splits the row count itself returns None.
    """
    outer = _prod(src_shape[: src.axis])
    block = sympy.simplify(src.inner * _prod(src_shape[src.axis + 1:]))
    for axis, size in enumerate(dst_shape):
        inner = rows_factor(size, rows)
        if inner is None:
            continue
        if sympy.simplify(_prod(dst_shape[:axis]) - outer) != 0:
            return None
        if sympy.simplify(inner * _prod(dst_shape[axis + 1:]) - block) != 0:
            return None
        return Layout(axis, inner)
    return None


def depends_on(value, symbol: sympy.Symbol) -> bool:
    """Whether an int / SymInt / FX node holding a SymInt depends on ``symbol``."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.SymInt):
        return symbol in value.node.expr.free_symbols
    return False
