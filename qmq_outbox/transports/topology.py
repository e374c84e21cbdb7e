"""Topology before traffic: the consumer groups a producer declares for its subjects.

On RabbitMQ a message is routed only to queues that exist when it is published, and on
JetStream a group that starts at ``latest`` misses what came before its durable consumer;
so a producer may declare, before its first publish, the groups each subject feeds
(``RabbitMqTransport(groups={"orders.created": ["billing"]})``, or ``qmq transport
declare``): their queues or durable consumers then exist before any consumer starts.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol, runtime_checkable

import qmq_wire
from qmq_outbox.errors import ConfigurationError

Groups = Mapping[str, Collection[str]]


@runtime_checkable
class Declaring(Protocol):
    """A transport that can declare its groups' topology ahead of their consumers."""

    def declare(self) -> list[str]:
        """Make sure of every declared group's queues or consumers (again: harmless);
        returns what it made sure of, one line each."""
        ...


def name_problem(value: object, kind: str) -> str | None:
    """Why ``value`` cannot be a subject or group name, or None when it can."""
    if not isinstance(value, str) or not qmq_wire.valid_name(value):
        return f"{value!r} is not a {kind} name (a letter or digit, then up to 199 of A-Za-z0-9._-)"
    if kind == "subject" and value.startswith(qmq_wire.RESERVED_PREFIX):
        return f"{value!r}: subjects starting with {qmq_wire.RESERVED_PREFIX} are reserved"
    return None


def group_pairs(groups: Groups) -> tuple[tuple[str, str], ...]:
    """``(group, subject)`` for each declared group of each subject, in the order given;
    ``ConfigurationError`` naming the first entry that is not a valid name."""
    pairs: list[tuple[str, str]] = []
    for subject, names in groups.items():
        problem = name_problem(subject, "subject")
        if problem is None and isinstance(names, str):
            problem = f"groups of {subject!r}: a list of names, not one string"
        if problem is not None:
            raise ConfigurationError(f"groups: {problem}")
        for group in names:
            problem = name_problem(group, "group")
            if problem is not None:
                raise ConfigurationError(f"groups[{subject!r}]: {problem}")
            if (group, subject) not in pairs:
                pairs.append((group, subject))
    return tuple(pairs)
