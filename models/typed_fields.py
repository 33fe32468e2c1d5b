"""A dataclass spec's plain fields checked against their annotations.

A spec is also read back from files (a run folder's `config.json`), and a file may have been written by
anyone: `"rounds": 2.5`, `"seed": "x"` or `"threads": [1]` must be refused in one line when the spec is
built, not fail deep inside a run. Only plain annotations are checked (bool, int, float, str, and those
`| None`); nested specs and pydantic messages validate themselves.
"""
from __future__ import annotations

import math
import numbers
import typing
from dataclasses import fields
from types import NoneType, UnionType

PLAIN = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def _accepts(kind: type, value) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:  # numpy's integers too
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def check_types(spec) -> None:
    """Raise ValueError naming the first plain field whose value is not of its annotated type."""
    hints = typing.get_type_hints(type(spec))
    for f in fields(spec):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, UnionType) else (hint,)
        kinds = [a for a in args if a in PLAIN]
        if not kinds or len(kinds) + (NoneType in args) != len(args):
            continue  # not a plain field: nested specs and containers check themselves
        value = getattr(spec, f.name)
        if (value is None and NoneType in args) or any(_accepts(k, value) for k in kinds):
            continue
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        wanted = " or ".join(PLAIN[k] for k in kinds) + (" or null" if NoneType in args else "")
        raise ValueError(f"{f.name} must be {wanted}, got {shown}")
