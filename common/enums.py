"""One way to turn user input (an enum member, its value, or another enum with the same values)
into an enum member, with one error format: what was unknown and what is accepted.

``parse_enum`` is the function; ``Parseable`` gives an enum its ``parse`` classmethod from the
class keywords (``class Compute(Parseable, enum.Enum, what="compute granularity")``), so no enum
writes the same wrapper again."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Self, TypeVar

__all__ = ["Parseable", "parse_enum"]

E = TypeVar("E", bound=enum.Enum)


def parse_enum(
    cls: type[E], value: object, *, what: str, aliases: Mapping[str, Any] | None = None,
    hint: str = "",
) -> E:
    """``cls`` member for ``value``: a member, a value string (case-insensitive), an alias (a
    lower-case name mapped to a member or to a member's value), or a member of another enum whose
    ``.value`` is one of ours. ValueError naming ``what`` otherwise."""
    if isinstance(value, cls):
        return value
    if isinstance(value, enum.Enum):
        value = value.value
    key = str(value).lower()
    if aliases and key in aliases:
        return cls(aliases[key])
    try:
        return cls(key)
    except ValueError:
        accepted = [m.value for m in cls] + sorted(aliases or ())
        raise ValueError(
            f"unknown {what} {value!r}: expected one of {accepted}{hint}"
        ) from None


class Parseable:
    """Mixin of an enum (before ``enum.Enum`` in its bases): ``parse(value)`` is ``parse_enum``
    with the class keywords ``what`` (the error's name for it), ``hint`` (appended to the error)
    and ``aliases`` (a mapping read at each call, so it may grow: more accepted names)."""

    _parse_keywords: dict[str, Any]

    def __init_subclass__(cls, *, what: str | None = None, hint: str = "",
                          aliases: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if what is not None:
            cls._parse_keywords = {"what": what, "hint": hint, "aliases": aliases}

    @classmethod
    def parse(cls, value: object) -> Self:
        return parse_enum(cls, value, **cls._parse_keywords)  # type: ignore[type-var]
