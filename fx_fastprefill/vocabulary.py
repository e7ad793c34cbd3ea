"""The base of the package's closed sets of names (graph modes, the reduced region's modes, what
a call does with its graph): enum members that compare, hash, print (repr included), format and serialize as
their plain strings, so counters keyed by them read as before and JSON records stay plain."""

from __future__ import annotations

import enum


class Vocabulary(str, enum.Enum):
    """A name from a closed set; equal to its string value."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # a counter keyed by these prints as it did with plain strings
        return repr(self.value)

    __format__ = str.__format__
