"""``from_url``: the transport a broker URL names, with options in its query string.

``http(s)://`` is the qmq broker; ``nats://`` JetStream; ``amqp(s)://`` RabbitMQ. A
transport's simple settings may ride along in the query (``nats://127.0.0.1:4222?
stream_prefix=ORDERS&lease=30s&max_attempts=5``), so a one-line change of URL switches
transports with their settings (durations read ``500ms``, ``30s``, ``5m``; a bare number is
seconds).
"""

from __future__ import annotations

import dataclasses
import importlib
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from qmq_outbox.dburl import mask_url
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.transports.base import Transport

SCHEMES = {
    "http": "qmq",
    "https": "qmq",
    "nats": "jetstream",
    "tls": "jetstream",
    "amqp": "rabbitmq",
    "amqps": "rabbitmq",
}
_EXTRAS = {"jetstream": "nats", "rabbitmq": "rabbitmq"}


def check_qmq_url(text: str) -> str:
    """``text`` if it is ``http(s)://host[:port]``; ``ConfigurationError`` otherwise. The
    clients add the API's paths themselves, so a path here would reach no route at all."""
    usage = f"{mask_url(text)!r} is not a broker URL: use http(s)://host[:port]"
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        raise ConfigurationError(usage) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(usage)
    if parts.path not in ("", "/"):
        raise ConfigurationError(f"{usage}, without a path (the client adds /v1/...)")
    if parts.username or parts.query or parts.fragment:
        raise ConfigurationError(f"{usage} (a token goes in token=, not in the URL)")
    return text


def from_url(url: str, *, token: str | None = None) -> Transport:
    """The transport ``url`` names (``token``: the qmq broker's bearer token)."""
    kind = SCHEMES.get(urlsplit(url).scheme.lower())
    if kind is None:
        raise ConfigurationError(
            f"{mask_url(url)!r} is not a broker URL: use http(s):// (the qmq broker), "
            "nats:// (NATS JetStream) or amqp(s):// (RabbitMQ)"
        )
    if kind == "qmq":
        from qmq_outbox.transports.qmq import QmqTransport

        return QmqTransport(url=url, token=token)
    try:
        module = importlib.import_module(f"qmq_outbox.transports.{kind}")
    except ImportError as exc:  # the library behind it is an extra
        raise ConfigurationError(
            f"the {kind} transport needs qmq-outbox[{_EXTRAS[kind]}] ({exc})"
        ) from exc
    transport: Transport = module.transport_from_url(url)
    return transport


def split_options(
    url: str, config: type[Any], *, keep_unknown: bool = False
) -> tuple[str, dict[str, Any]]:
    """``url`` without the query parameters that name simple fields of the dataclass
    ``config`` (bool, int, float, str, timedelta defaults), and those values converted.
    Other parameters stay in the URL (``keep_unknown``) or are refused."""
    parts = urlsplit(url)
    fields = {
        field.name: field.default
        for field in dataclasses.fields(config)
        if field.name != "url" and isinstance(field.default, bool | int | float | str | timedelta)
    }
    options: dict[str, Any] = {}
    kept: list[tuple[str, str]] = []
    for name, text in parse_qsl(parts.query, keep_blank_values=True):
        if name not in fields:
            if keep_unknown:
                kept.append((name, text))
                continue
            known = ", ".join(sorted(fields))
            raise ConfigurationError(f"unknown option {name!r} in {mask_url(url)!r} ({known})")
        options[name] = _convert(name, text, fields[name])
    query = "&".join(f"{name}={text}" for name, text in kept)
    return urlunsplit(parts._replace(query=query)), options


def _convert(name: str, text: str, default: object) -> Any:
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError("use true or false")
            return text.lower() in ("true", "1", "yes")
        if isinstance(default, timedelta):
            from qmq_cli.options import parse_duration  # the CLI's duration syntax

            return parse_duration(text)
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError as exc:
        raise ConfigurationError(f"URL option {name}={text!r}: {exc}") from None
    return text
