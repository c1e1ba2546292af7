"""Command-line flags derived from typed option dataclasses.

An option dataclass declares each field as ``name: type = default  # unit comment``.
Its flag is ``--kebab-name``; the value type follows the default (an enum gives
its choices, a ``None`` default the non-None type of the annotation, a bool
default ``--name/--no-name``) and the help text is the unit comment. A new field
therefore needs one edit: its declaration. Used for the run flags
(:mod:`blocktrain.cli.common`) and the coordinator's settings
(:mod:`blocktrain.cli.distributed`).
"""

from __future__ import annotations

import argparse
import enum
import functools
import inspect
import re
import types
import typing
from dataclasses import MISSING, Field, fields
from typing import Any


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Unit comments of a dataclass's fields, read from its source: ``name: type = default  # comment``."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s+(\w+): [^=\n]+=[^#\n]*#\s*(.+)$", src, re.M)}


def _field(cls: type, name: str) -> Field[Any]:
    return next(f for f in fields(cls) if f.name == name)


def _annotated_type(cls: type, name: str) -> type | None:
    """The one non-None type of field ``name``'s annotation (``float | None`` -> float), else None."""
    hint = typing.get_type_hints(cls).get(name)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = options[0] if len(options) == 1 else None
    return hint if isinstance(hint, type) else None


def arg_type(cls: type, name: str) -> dict[str, Any]:
    """``add_argument`` keywords for the value of field ``name``: type (and choices for an enum) from its default."""
    f = _field(cls, name)
    default = f.default if f.default is not MISSING else None
    if isinstance(default, enum.Enum):
        enum_cls = type(default)
        return {"type": enum_cls, "choices": list(enum_cls), "metavar": "{" + ",".join(e.value for e in enum_cls) + "}"}
    if default is None:
        annotated = _annotated_type(cls, name)
        if annotated is not None and issubclass(annotated, enum.Enum):
            return {"type": annotated, "choices": list(annotated),
                    "metavar": "{" + ",".join(e.value for e in annotated) + "}"}
        return {"type": annotated or str, "metavar": name.upper()}
    if isinstance(default, tuple):  # a tuple of strings: comma-separated on the command line
        return {"type": comma_list, "metavar": "A,B,..."}
    return {"type": type(default), "metavar": name.upper()}


def comma_list(text: str) -> tuple[str, ...]:
    """``'*.txt, *.md'`` -> ``('*.txt', '*.md')``."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def flag_name(name: str) -> str:
    """``round_seconds`` -> ``--round-seconds``."""
    return "--" + name.replace("_", "-")


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}__{name}"


def add_field_flags(p: argparse.ArgumentParser, cls: type, *, prefix: str, notes: dict[str, str] | None = None) -> None:
    """One flag per field of dataclass ``cls`` (all default to None: "not given"; read them with :func:`field_values`).

    ``prefix`` keeps the destinations apart from other flags; ``notes`` adds text to a field's help.
    """
    comments = field_comments(cls)
    for f in fields(cls):
        shown = f.default.value if isinstance(f.default, enum.Enum) else f.default
        if isinstance(shown, tuple):
            shown = ",".join(shown)
        help_ = comments.get(f.name, f.name) + (notes or {}).get(f.name, "")
        if f.default is not MISSING and f.default is not None:  # None: off unless given
            help_ += f" (default: {shown})"
        help_ = help_.replace("%", "%%")  # argparse formats help with %
        if isinstance(f.default, bool):
            p.add_argument(flag_name(f.name), dest=_dest(prefix, f.name), default=None,
                           action=argparse.BooleanOptionalAction, help=help_)
        else:
            p.add_argument(flag_name(f.name), dest=_dest(prefix, f.name), default=None, help=help_,
                           **arg_type(cls, f.name))


def field_values(args: argparse.Namespace, cls: type, *, prefix: str) -> dict[str, Any]:
    """The fields of ``cls`` given on the command line (flags added by :func:`add_field_flags`), by field name."""
    given = {f.name: getattr(args, _dest(prefix, f.name), None) for f in fields(cls)}
    return {name: value for name, value in given.items() if value is not None}
