"""Click options derived from dataclass fields, and the value types they read.

Each default, help text and unit is written once, on the field it configures::

    ack_timeout_s: float = option_field(30.0, "Lease of a pulled message.", "duration")

becomes ``--ack-timeout DURATION`` (default ``30s``), also read from the environment
variable ``<PREFIX>_ACK_TIMEOUT`` and shown in ``--help``; the command gets the value under
the field's name, converted to the field's type (here float seconds). A field without a
default (``dataclasses.field(metadata={...})``) is a required option.

Metadata keys: ``help`` and ``unit`` (required); ``option`` (a name other than the derived
one); ``min``/``max`` (bounds of numbers); ``choices`` and ``case_sensitive``; ``multiple``;
``metavar``; ``hidden``. ``UNITS`` holds the units (a command may add its own): a unit gives
the click type, how a default is typed on the command line, and how the field's name suffix
reads as an option (``retention_s`` -> ``--retention``, ``segment_bytes`` ->
``--segment-size``, ``time_slice_s`` -> ``--time-slice-ms``).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Config = TypeVar("Config", bound="DataclassInstance")
Value = TypeVar("Value")
Decorated = TypeVar("Decorated", bound=Callable[..., Any])

METADATA_KEYS = frozenset(
    {
        "help",
        "unit",
        "option",
        "min",
        "max",
        "choices",
        "case_sensitive",
        "multiple",
        "metavar",
        "hidden",
    }
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def option_field(default: Value, help: str, unit: str, **more: object) -> Value:
    """A dataclass field with a default and the metadata of its option (keys as above)."""
    metadata = {"help": help, "unit": unit, **more}
    return dataclasses.field(default=default, metadata=metadata)


def parse_duration(text: str) -> timedelta:
    """``500ms``, ``30s``, ``5m``, ``2h``, ``7d``; a bare number means seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration (use e.g. 500ms, 30s, 5m, 2h, 7d)")
    return timedelta(seconds=float(match.group(1)) * _SECONDS[match.group(2) or "s"])


def format_duration(value: timedelta | float) -> str:
    """The shortest way to type ``value`` (a timedelta or seconds): ``30s``, ``5m``, ``7d``."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    for suffix, size in _SECONDS.items():
        count = seconds / size
        if count == int(count) and (count or suffix == "s"):
            return f"{int(count)}{suffix}"
    return f"{seconds:g}s"


def parse_timestamp(text: str) -> datetime:
    """RFC 3339 / ISO 8601 (``2024-05-01T12:00:00Z``, ``2024-05-01``); naive means UTC."""
    try:
        parsed = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a timestamp (use e.g. 2024-05-01T12:00:00Z)") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


class Parsed(click.ParamType):  # type: ignore[type-arg]
    """A value read by ``parse``; its ``ValueError`` is the usage error's message."""

    def __init__(self, name: str, parse: Callable[[str], Any], *, result: type) -> None:
        self.name = name
        self.parse = parse
        self.result = result

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, self.result):
            return value
        try:
            return self.parse(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = Parsed("duration", parse_duration, result=timedelta)
SECONDS = Parsed("duration", lambda text: parse_duration(text).total_seconds(), result=float)
TIMESTAMP = Parsed("timestamp", parse_timestamp, result=datetime)


class Milliseconds(click.FloatRange):
    """A number of milliseconds on the command line, seconds in the program."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        milliseconds: float = super().convert(value, param, ctx)
        return milliseconds / 1000


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unit:
    """How values of one kind read on the command line."""

    type: click.ParamType  # type: ignore[type-arg]
    show: Callable[[Any], str] = str  # a field's default as one would type it
    rename: tuple[str, str] = ("", "")  # field-name suffix -> option-name suffix


def _duration(meta: Mapping[str, Any], annotation: object) -> Unit:
    kind = SECONDS if annotation is float else DURATION
    return Unit(type=kind, show=format_duration, rename=("_s", ""))


def _milliseconds(meta: Mapping[str, Any], annotation: object) -> Unit:
    bounds = Milliseconds(meta.get("min"), meta.get("max"))
    return Unit(type=bounds, show=lambda seconds: f"{seconds * 1000:g}", rename=("_s", "-ms"))


def _bytes(meta: Mapping[str, Any], annotation: object) -> Unit:
    return Unit(type=click.IntRange(meta.get("min"), meta.get("max")), rename=("_bytes", "-size"))


def _count(meta: Mapping[str, Any], annotation: object) -> Unit:
    return Unit(type=click.IntRange(meta.get("min"), meta.get("max")))


def _choice(meta: Mapping[str, Any], annotation: object) -> Unit:
    return Unit(type=click.Choice(meta["choices"], case_sensitive=meta.get("case_sensitive", True)))


UNITS: Mapping[str, Callable[[Mapping[str, Any], object], Unit]] = {
    "duration": _duration,  # 500ms, 30s, 5m, 2h, 7d: float seconds or timedelta
    "milliseconds": _milliseconds,  # a number of ms for a float-seconds field
    "bytes": _bytes,
    "count": _count,
    "choice": _choice,
    "text": lambda meta, annotation: Unit(type=click.STRING),
    "timestamp": lambda meta, annotation: Unit(type=TIMESTAMP),
    "directory": lambda meta, annotation: Unit(type=click.Path(file_okay=False, path_type=Path)),
    "file": lambda meta, annotation: Unit(
        type=click.Path(dir_okay=False, exists=True, path_type=Path)
    ),
    "flag": lambda meta, annotation: Unit(type=click.BOOL),
}


def option_name(field: dataclasses.Field[Any], unit: Unit) -> str:
    """``--ack-timeout`` for ``ack_timeout_s``: the unit's suffix rule, dashes for underscores."""
    suffix, replacement = unit.rename
    name = field.name
    if suffix and name.endswith(suffix):
        name = name.removesuffix(suffix) + replacement
    return "--" + name.replace("_", "-")


def envvar_name(prefix: str, option: str) -> str:
    """``QMQ_BROKER_ACK_TIMEOUT`` for ``--ack-timeout`` under ``QMQ_BROKER``."""
    return f"{prefix}_{option.removeprefix('--').replace('-', '_').upper()}"


def options_from(
    config: type[DataclassInstance], *, envvar_prefix: str, units: Mapping[str, Unit] | None = None
) -> Callable[[Decorated], Decorated]:
    """Decorate a click command with one option per field of the dataclass ``config``.

    ``units`` adds the command's own units (ready-made, by name) to ``UNITS``.
    """
    hints = typing.get_type_hints(config)
    options = [
        _option(field, hints[field.name], envvar_prefix, units or {})
        for field in dataclasses.fields(config)
    ]

    def decorate(command: Decorated) -> Decorated:
        for decls, attrs in reversed(options):  # click lists the last one applied first
            command = click.option(*decls, **attrs)(command)
        return command

    return decorate


def take(config: type[Config], values: dict[str, Any]) -> Config:
    """Build ``config`` from the command's values named by its fields, removing them."""
    fields = dataclasses.fields(config)
    return config(**{field.name: values.pop(field.name) for field in fields})


def _option(
    field: dataclasses.Field[Any], annotation: object, envvar_prefix: str, units: Mapping[str, Unit]
) -> tuple[tuple[str, str], dict[str, Any]]:
    """The declarations and attributes of ``field``'s click option."""
    meta = field.metadata
    unknown = set(meta) - METADATA_KEYS
    if unknown or "help" not in meta or "unit" not in meta:
        raise TypeError(f"{field.name}: option metadata needs help and unit, not {sorted(unknown)}")
    unit = units.get(meta["unit"]) or UNITS[meta["unit"]](meta, annotation)
    name = meta.get("option") or option_name(field, unit)
    decls = (name, field.name)
    attrs: dict[str, Any] = {
        "help": meta["help"],
        "envvar": envvar_name(envvar_prefix, name),
        "show_envvar": True,
        "hidden": meta.get("hidden", False),
        "metavar": meta.get("metavar"),
    }
    if meta["unit"] == "flag":
        attrs.update(is_flag=True, default=field.default)
        return decls, attrs
    attrs.update(type=unit.type, multiple=meta.get("multiple", False))
    if field.default is dataclasses.MISSING:
        attrs["required"] = True
    elif field.default is None or attrs["multiple"]:
        attrs["default"] = field.default
    else:
        attrs["default"] = unit.show(field.default)
    return decls, attrs
