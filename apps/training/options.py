"""Command-line options defined once: on the dataclass fields they set.

A field declared with ``option(default, Group.X, help=...)`` carries an ``Option`` in its
metadata, and ``add_options(parser, *classes)`` adds one argparse argument per such field:

- the flag is ``--field-name`` (underscores become dashes), ``dest`` the field's name;
- an enum-typed field (``Weights``, ``Activations | None``) takes its enum's values as choices,
  and the parsed value stays the string (the dataclass parses it in ``__post_init__``);
- a bool field is a flag: ``store_true`` when it defaults to False, ``--no-field-name``
  (``store_false``) when it defaults to True;
- a field holding a dataclass (``TrainJob.kernels``, a ``KernelConfig``) adds one flag per
  field of that class (``--backend``, ``--gemm``), and is None when none of them is given;
- ``Option.parse`` checks a value as argparse reads it (``positive(int)``); argparse's error
  then names the flag.

A field made with ``internal(default, why)`` has no flag (the command line sets it itself).
``from_args(cls, args)`` builds the dataclass from the parsed namespace and ``to_argv(obj)``
writes the flags that give ``obj`` back (the tests round-trip a job through both).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = [
    "Group",
    "Option",
    "add_options",
    "flags",
    "from_args",
    "internal",
    "non_negative_float",
    "non_negative_int",
    "option",
    "positive",
    "to_argv",
]

T = TypeVar("T")

_KEY = "option"  # the field metadata key


class Group(enum.Enum):
    """The help page's sections, in this order."""

    WHERE = "where it runs"
    MODEL = "model and numerics"
    OPTIM = "optimisation and data"
    OUTPUTS = "outputs and checkpoints"


@dataclasses.dataclass(frozen=True)
class Option:
    """How one dataclass field appears on the command line (see the module docstring)."""

    group: Group
    help: str | None = None
    parse: Callable[[str], object] | None = None  # argparse ``type``; default: the field's type
    choices: tuple[str, ...] | None = None  # default: the enum's values, for an enum field
    nested_help: Mapping[str, str] = dataclasses.field(default_factory=dict)  # per sub-field


# ``option`` and ``internal`` return ``dataclasses.field(...)``, typed ``Any`` as that function's
# own overloads type it for checkers: ``steps: int = option(40, ...)`` declares an int field.


def option(default: object, group: Group, *, help: str | None = None, **kwargs: Any) -> Any:
    """A dataclass field with a command-line flag (``Option``'s other fields as keywords)."""
    spec = Option(group, help, **kwargs)
    return dataclasses.field(default=default, metadata={_KEY: spec})


def internal(default: object, why: str) -> Any:
    """A dataclass field with no flag; ``why`` says who sets it instead."""
    return dataclasses.field(default=default, metadata={_KEY: None, "why": why})


def positive(kind: type) -> Callable[[str], object]:
    """argparse type: a finite ``kind`` (int or float) > 0."""

    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
        return value

    parse.__name__ = f"positive {kind.__name__}"  # argparse names it in "invalid ... value"
    return parse


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


class _Arg(typing.NamedTuple):
    """One argparse argument of a field (a nested dataclass field has several)."""

    flag: str
    dest: str
    kwargs: dict
    sub: str | None  # the sub-field of a nested dataclass field, else None


def _base(hint: Any) -> Any:
    """``X | None`` -> X; any other hint as it is."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(kinds) == 1, f"an option field holds one type (or None), not {hint}"
        return kinds[0]
    return hint


def _leaf_kwargs(kind: type, default: object, spec: Option, help_text: str | None) -> dict:
    if kind is bool:
        return {"action": "store_false" if default else "store_true", "help": help_text}
    kwargs: dict[str, Any] = {"default": default, "help": help_text}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        kwargs["choices"] = spec.choices or tuple(m.value for m in kind)
        kwargs["default"] = default.value if isinstance(default, enum.Enum) else default
    else:
        kwargs["type"] = spec.parse or kind
        if spec.choices:
            kwargs["choices"] = spec.choices
    return kwargs


def _args(cls: type) -> list[tuple[Option, _Arg]]:
    """Every argparse argument of the dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None:
            assert _KEY in f.metadata, f"{cls.__name__}.{f.name}: use option() or internal()"
            continue
        kind = _base(hints[f.name])
        if dataclasses.is_dataclass(kind):
            sub_hints = typing.get_type_hints(kind)
            for s in dataclasses.fields(kind):
                kwargs = _leaf_kwargs(_base(sub_hints[s.name]), None, spec,
                                      spec.nested_help.get(s.name))
                out.append((spec, _Arg("--" + s.name.replace("_", "-"), f"{f.name}.{s.name}",
                                       kwargs, s.name)))
            continue
        name = f"no_{f.name}" if kind is bool and f.default else f.name
        out.append((spec, _Arg("--" + name.replace("_", "-"), f.name,
                               _leaf_kwargs(kind, f.default, spec, spec.help), None)))
    return out


def add_options(parser: argparse.ArgumentParser, *classes: type) -> None:
    """One argument per option field of each class, in ``Group`` sections (the order of the
    groups, then of the classes and their fields)."""
    every = [a for cls in classes for a in _args(cls)]
    for group in Group:
        section = parser.add_argument_group(group.value)
        for spec, arg in every:
            if spec.group is group:
                section.add_argument(arg.flag, dest=arg.dest, **arg.kwargs)


def flags(cls: type) -> dict[str, list[str]]:
    """Field name -> its flags (one, or one per sub-field of a nested dataclass field)."""
    out: dict[str, list[str]] = {}
    for _, arg in _args(cls):
        out.setdefault(arg.dest.split(".")[0], []).append(arg.flag)
    return out


def from_args(cls: type[T], args: argparse.Namespace, **fixed: object) -> T:
    """``cls`` from the parsed flags of its option fields; ``fixed`` sets the others."""
    values = vars(args)
    kwargs: dict = {}
    nested: dict[str, dict] = {}
    for _, arg in _args(cls):
        if arg.sub is None:
            kwargs[arg.dest] = values[arg.dest]
        else:
            nested.setdefault(arg.dest.split(".")[0], {})[arg.sub] = values[arg.dest]
    hints = typing.get_type_hints(cls)
    for name, parts in nested.items():
        given = {k: v for k, v in parts.items() if v is not None}
        kwargs[name] = _base(hints[name])(**given) if given else None
    return cls(**kwargs, **fixed)


def to_argv(obj: object) -> list[str]:
    """The flags that make ``from_args(type(obj), parse(argv))`` equal ``obj`` (fields without
    a flag excepted); values equal to the default, and None, are left out."""
    argv: list[str] = []
    for _, arg in _args(type(obj)):
        value = getattr(obj, arg.dest.split(".")[0])
        if arg.sub is not None:
            value = None if value is None else getattr(value, arg.sub)
        if isinstance(value, enum.Enum):
            value = value.value
        default = arg.kwargs.get("default")
        if arg.kwargs.get("action") in ("store_true", "store_false"):
            if value != (arg.kwargs["action"] == "store_false"):
                argv.append(arg.flag)
        elif value is not None and value != default:
            argv += [arg.flag, repr(value) if isinstance(value, float) else str(value)]
    return argv
