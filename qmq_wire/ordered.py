"""Ordered subjects: the rules every part computes alike (docs/architecture.md, 3.6).

The broker routes by these, the SDK and the reconciliation read partitions and command
messages by these; nothing here does I/O.
"""

from __future__ import annotations

import zlib
from typing import Final

LOGIC_PARTITIONS: Final = 1024
"""Logic partitions of every ordered subject, fixed for ever."""
MAX_PARTITIONS: Final = 64
"""Physical partitions an ordered subject may be declared with."""
PARTITION_SEPARATOR: Final = "#"
"""Between a subject and a partition number in a partition's log name (never in a name)."""
COMMAND_HEADER: Final = "qmq-command"
"""Header that marks a command message (value ``route``); command messages are not served."""
ROUTE_VERSION_HEADER: Final = "qmq-route-version"
"""Header of a command message: the route version whose change closed the partition."""
COMMAND_PRODUCER: Final = "_qmq"
ON_DEAD: Final = ("skip", "block")


def logic_partition(key: str) -> int:
    """A key's logic partition: CRC-32 (zlib, ``java.util.zip.CRC32``) of its UTF-8 bytes
    modulo ``LOGIC_PARTITIONS``."""
    return zlib.crc32(key.encode()) % LOGIC_PARTITIONS


def partition_log(subject: str, partition: int) -> str:
    """The name of the log that stores physical partition ``partition`` of ``subject``."""
    return f"{subject}{PARTITION_SEPARATOR}{partition}"


def split_partition_log(name: str) -> tuple[str, int | None]:
    """(subject, partition) of a stored log name; (name, None) for a plain subject."""
    subject, separator, number = name.rpartition(PARTITION_SEPARATOR)
    if not separator or not number.isdigit():
        return name, None
    return subject, int(number)


def command_id(version: int, partition: int) -> str:
    """The id of the command message that closed ``partition`` at route ``version``."""
    return f"_qmq.route.{version}.{partition}"


def is_command(headers: dict[str, str]) -> bool:
    """Whether a stored message is a command message (never served, never reported)."""
    return COMMAND_HEADER in headers
