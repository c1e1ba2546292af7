"""The CLI's one flag builder: flags derived from typed option dataclasses, and the options built back.

An option dataclass declares each field as ``name: type = default  # unit comment``. :class:`Flags` gives it one
flag per field, ``--kebab-name`` (``x_s`` also ``--x``), typed by the default (an enum: its choices; a tuple: its
elements, comma-separated; None: the annotation; a bool: ``--name/--no-name``), its help the comment, the default and
its unit. Every flag defaults to None, "not given", so the dataclass default applies and is never typed twice. A field
may be renamed to a flag in another unit named by its suffix (``--delay-ms`` for ``link_delay_s``, ``--max-frame-mib``
for ``max_frame_bytes``), converted back into the field's. A new field needs one edit: its declaration.
"""

from __future__ import annotations

import argparse
import enum
import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# Flag name suffix -> (unit shown in the help, field units per flag unit): milliseconds to seconds, MiB/KiB to bytes.
UNITS: dict[str, tuple[str, float]] = {"ms": ("ms", 1e-3), "mib": ("MiB", 2**20), "kib": ("KiB", 1024)}
_FIELD_UNIT = re.compile(r"^(bytes|seconds|s|ms):\s*")  # a comment's leading unit, dropped by a converting flag
_NAME_UNITS = {"_s": "s", "_seconds": "s", "_ms": "ms", "_bytes": "bytes", "_mib": "MiB", "_gib": "GiB"}  # field suffixes


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Unit comments of a dataclass's fields, read from its source: ``name: type [= default]  # comment``."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s+(\w+): [^=#\n]+(?:=[^#\n]*)?#\s*(.+)$", src, re.M)}


def flag_name(name: str) -> str:
    """``round_seconds`` -> ``--round-seconds``."""
    return "--" + name.replace("_", "-")


def _comma_tuple(element: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """A parser of ``'a, b'`` into ``(element('a'), element('b'))``."""
    return lambda text: tuple(element(x.strip()) for x in text.split(",") if x.strip())


def _default(f: Field[Any]) -> Any:
    """A field's default (its factory's value), MISSING when it has none."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _annotated_type(cls: type, name: str) -> type | None:
    """The one non-None type of field ``name``'s annotation (``float | None`` -> float), else None."""
    hint = typing.get_type_hints(cls).get(name)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = options[0] if len(options) == 1 else None
    return hint if isinstance(hint, type) else None


def _text(value: Any, help_: bool = False) -> str:
    """A value as a flag takes it (in a help, floats shortened)."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value.value) if isinstance(value, enum.Enum) else f"{value:g}" if help_ and isinstance(value, float) else str(value)


def arg_type(cls: type, name: str) -> dict[str, Any]:
    """``add_argument`` keywords for the value of field ``name``: its type (an enum's choices) from the default."""
    default = _default(next(f for f in fields(cls) if f.name == name))
    kind = type(default) if default not in (None, MISSING) else _annotated_type(cls, name) or str
    if issubclass(kind, enum.Enum):
        return {"type": kind, "choices": list(kind), "metavar": "{" + ",".join(e.value for e in kind) + "}"}
    if isinstance(default, tuple):  # comma-separated on the command line, elements of the default's type
        return {"type": _comma_tuple(type(default[0]) if default else str), "metavar": "A,B,..."}
    return {"type": kind, "metavar": name.upper()}


@dataclass(frozen=True)
class Flags(Generic[T]):
    """The flags of option dataclass ``cls``; argparse keeps field ``f``'s value under ``prefix + f``."""

    cls: type[T]
    prefix: str
    rename: Mapping[str, str] = field(default_factory=dict)  # field -> its flag; a unit suffix (-ms, -mib) converts
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # field -> more names of its flag
    skip: Collection[str] = ()  # fields the command sets itself (parsed, secret or computed)
    only: Collection[str] | None = None  # flag only these fields
    default_text: Mapping[str, str] = field(default_factory=dict)  # the help's default where another flag sets it
    help_format: str = "{comment}"  # the help before its default; {name} and {comment}
    show_default: bool = True  # False where the default comes from elsewhere (a preset)

    def fields(self) -> list[Field[Any]]:
        """The fields that have flags."""
        every = fields(typing.cast(type, self.cls))
        return [f for f in every if f.name not in self.skip and (self.only is None or f.name in self.only)]

    def flag(self, name: str) -> str:
        return self.rename.get(name, flag_name(name))

    def _unit(self, name: str) -> tuple[str, float] | None:
        """The unit of a renamed field's flag, where it converts."""
        return UNITS.get(self.rename[name].rsplit("-", 1)[-1]) if name in self.rename else None

    def add(self, p: argparse.ArgumentParser) -> None:
        """Add one flag per field to ``p``."""
        comments = field_comments(typing.cast(type, self.cls))
        for f in self.fields():
            names = [self.flag(f.name), *self.aliases.get(f.name, ())]
            if f.name.endswith("_s") and f.name not in self.rename:
                names.insert(1, flag_name(f.name.removesuffix("_s")))
            default, unit = _default(f), self._unit(f.name)
            comment = comments.get(f.name, f.name)
            kw: dict[str, Any] = {"type": float, "metavar": unit[0].upper()} if unit else arg_type(self.cls, f.name)
            if unit:
                comment = _FIELD_UNIT.sub("", comment)
                default = default / unit[1] if isinstance(default, int | float) else default
            help_ = self.help_format.format(name=f.name, comment=comment)
            shown = self.default_text.get(f.name, _text(default, help_=True) if default not in (None, MISSING) else None)
            if self.show_default and shown is not None:
                in_unit = unit[0] if unit else next((u for sfx, u in _NAME_UNITS.items() if f.name.endswith(sfx)), "")
                help_ += f" (default: {shown}{' ' + in_unit if in_unit and f.name not in self.default_text else ''})"
            if isinstance(default, bool):
                kw = {"action": argparse.BooleanOptionalAction}
            p.add_argument(*names, dest=self.prefix + f.name, default=None, required=default is MISSING,
                           help=help_.replace("%", "%%"), **kw)  # argparse formats help with %

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """The fields whose flags were given, by name, as given (in the flags' units)."""
        return {f.name: v for f in self.fields() if (v := getattr(args, self.prefix + f.name, None)) is not None}

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """The fields whose flags were given, by name, in the fields' units."""
        out = self.given(args)
        for name, value in out.items():
            if unit := self._unit(name):
                whole = isinstance(_default(next(f for f in self.fields() if f.name == name)), int)
                out[name] = int(value * unit[1]) if whole else value * unit[1]
        return out

    def build(self, args: argparse.Namespace, **extra: Any) -> T:
        """The options object: the given flags, ``extra`` for the fields the command sets, defaults for the rest."""
        return self.cls(**self.values(args), **extra)
