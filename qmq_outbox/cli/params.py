"""Click parameter types shared by the subcommands."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import click

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str) -> timedelta:
    """``500ms``, ``30s``, ``5m``, ``2h``, ``7d``; a bare number means seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration (use e.g. 500ms, 30s, 5m, 2h, 7d)")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


class Duration(click.ParamType):  # type: ignore[type-arg]
    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = Duration()
