"""One way to turn user input (an enum member, its value, or another enum with the same values)
into an enum member, with one error format: what was unknown and what is accepted."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["parse_enum"]

E = TypeVar("E", bound=enum.Enum)


def parse_enum(
    cls: type[E], value: object, *, what: str, aliases: Mapping[str, E] | None = None,
    hint: str = "",
) -> E:
    """``cls`` member for ``value``: a member, a value string (case-insensitive), an alias, or a
    member of another enum whose ``.value`` is one of ours. ValueError naming ``what`` otherwise."""
    if isinstance(value, cls):
        return value
    if isinstance(value, enum.Enum):
        value = value.value
    key = str(value).lower()
    if aliases and key in aliases:
        return aliases[key]
    try:
        return cls(key)
    except ValueError:
        accepted = [m.value for m in cls] + sorted(aliases or ())
        raise ValueError(
            f"unknown {what} {value!r}: expected one of {accepted}{hint}"
        ) from None
