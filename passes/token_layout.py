"""Where the token rows live in a tensor, and how that place moves through views.

Invariants:
- A layout ``(axis, inner, outer)`` says dimension ``axis`` has size ``outer * rows * inner`` and
  element ``i`` of that dimension belongs to row ``(i // inner) % rows``. Plain row-aligned tensors
  have ``inner == outer == 1``; ``inner > 1`` appears when a view merges the token dim with the
  dims after it, ``outer > 1`` when it merges a batch dim before it (``[B, S, H] -> [B*S, H]``).
- Sizes are sympy expressions; the row count is one free symbol (``T`` in the full graph), or in a
  graph traced with static shapes an integer, found from the row selection and followed through
  views by position (prefix and block), not by value.
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
    outer: sympy.Expr = sympy.Integer(1)

    @property
    def plain(self) -> bool:
        return self.inner == 1 and self.outer == 1

    def moved(self, axis: int) -> "Layout":
        """The same row grouping on another dim."""
        return Layout(axis, self.inner, self.outer)

    def __str__(self) -> str:
        text = f"dim {self.axis}"
        if self.inner != 1:
            text += f" (blocks of {self.inner})"
        if self.outer != 1:
            text += f" ({self.outer} sequences)"
        return text


def size_expr(value) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(int(value))


def same_size(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Two sizes provably equal for every value of their symbols. A test on expressions, not a
    guard: what cannot be proved is treated as different, and the rewrite that needed it is not
    made. (``statically_known_true`` answers the same for SymInts; the passes reason over the
    expressions, which they also divide and factor.)"""
    return sympy.simplify(a - b) == 0


def shape_exprs(val) -> list[sympy.Expr] | None:
    if not isinstance(val, torch.Tensor):
        return None
    return [size_expr(s) for s in val.shape]


def _prod(values: Sequence[sympy.Expr]) -> sympy.Expr:
    out = sympy.Integer(1)
    for v in values:
        out = out * v
    return out


def map_view_layout(src_shape: Sequence[sympy.Expr], src: Layout, dst_shape: Sequence[sympy.Expr],
                    rows: sympy.Expr) -> Layout | None:
    """The layout of the rows after viewing a row-major tensor of ``src_shape`` as ``dst_shape``.

    In memory the rows sit between a prefix (every dim before the token dim, times ``outer``) and a
    block (``inner`` times every dim after it). A view keeps rows addressable when one dim of
    ``dst_shape`` splits that same prefix and block; a view that splits the row count itself
    returns None. ``rows`` is a symbol, or the token count of a static graph: that dim is then found
    by the prefix and the block alone (for more than one row it is unique), never by a size equal
    to the token count, which another dim may share.
    """
    prefix = sympy.simplify(_prod(src_shape[: src.axis]) * src.outer)
    block = sympy.simplify(src.inner * _prod(src_shape[src.axis + 1:]))
    found = []
    for axis, size in enumerate(dst_shape):
        if not rows.is_number and rows not in size.free_symbols:
            continue
        outer = sympy.simplify(prefix / _prod(dst_shape[:axis]))
        inner = sympy.simplify(block / _prod(dst_shape[axis + 1:]))
        if all(is_factor(f, rows) for f in (outer, inner)) and same_size(size, outer * rows * inner):
            found.append(Layout(axis, inner, outer))
    return found[0] if len(found) == 1 else None


def is_factor(factor: sympy.Expr, rows: sympy.Expr) -> bool:
    """A grouping factor: a positive integer or a product of sizes, free of the row count."""
    if not rows.is_number and rows in factor.free_symbols:
        return False
    if factor.is_number:  # (a zero-size dim makes 0/0 or x/0: NaN or complex infinity, not a factor)
        return bool(factor.is_Integer and factor > 0)
    return _is_monomial(factor)


def _is_monomial(expr: sympy.Expr) -> bool:
    """A product of symbols and a positive integer: a size, not a ratio of sizes."""
    numerator, denominator = sympy.fraction(sympy.factor(expr))
    return denominator == 1 and (numerator.is_Mul or numerator.is_Symbol)


def depends_on(value, symbol: sympy.Expr) -> bool:
    """Whether an int / SymInt / FX node holding a SymInt depends on ``symbol`` (never, for the
    integer row count of a static graph: its sizes are constants)."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.SymInt):
        return symbol in value.node.expr.free_symbols
    return False
