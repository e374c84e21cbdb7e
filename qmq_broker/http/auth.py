"""Optional bearer-token auth with rights per subject and group, from a JSON file.

File format (``docs/broker.md``, Auth)::

    {"tokens": [
      {"name": "orders", "token": "s3cret-1", "produce": ["order.*"]},
      {"name": "billing", "token": "s3cret-2",
       "consume": [{"subject": "order.*", "groups": ["billing"]}]},
      {"name": "ops", "token": "s3cret-3", "manage": ["*"]},
      {"name": "root", "token": "s3cret-4", "admin": true}
    ]}

``produce`` lists subject patterns. ``consume`` (pull, ack, nack) and ``manage`` (dead
letters, redrive; ``/v1/schedule`` needs ``manage`` on every subject, ``"*"``) list subject
patterns, meaning every group, or ``{"subject", "groups"}`` objects naming group patterns.
``admin`` has every right. Patterns are shell-style (``fnmatch``) over the naming rules'
characters. The file is checked strictly when the broker starts: a wrong type, an unknown
key, an empty or non-ASCII token, or a token given twice is an error naming the entry.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hmac
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qmq_broker.errors import ConfigError, Denied

PATTERN = r"^[A-Za-z0-9._\-*?\[\]!]{1,200}$"
"""A subject or group pattern: the naming rules' characters and ``fnmatch``'s ``*?[]!``."""
TOKEN = r"^[\x21-\x7e]{1,1024}$"
"""A token: 1 to 1024 printable ASCII characters, no spaces."""

Pattern = Annotated[str, Field(pattern=PATTERN)]


class Right(StrEnum):
    PRODUCE = "produce"
    CONSUME = "consume"
    MANAGE = "manage"


class _GroupRight(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    subject: Pattern
    groups: list[Pattern] = Field(min_length=1)


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    name: str = Field(min_length=1, max_length=200, pattern=r"^[\x20-\x7e]+$")
    token: str = Field(pattern=TOKEN)
    produce: list[Pattern] = []
    consume: list[Pattern | _GroupRight] = []
    manage: list[Pattern | _GroupRight] = []
    admin: bool = False


class _TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    tokens: list[_Entry]


@dataclasses.dataclass(frozen=True, slots=True)
class Scope:
    """A subject pattern and the group patterns it covers (``None``: every group)."""

    subject: str
    groups: tuple[str, ...] | None = None

    def covers(self, subject: str, group: str | None) -> bool:
        if not fnmatch.fnmatchcase(subject, self.subject):
            return False
        if group is None or self.groups is None:
            return True
        return any(fnmatch.fnmatchcase(group, p) for p in self.groups)


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """What one token may do."""

    name: str
    token: bytes
    produce: tuple[Scope, ...] = ()
    consume: tuple[Scope, ...] = ()
    manage: tuple[Scope, ...] = ()
    admin: bool = False

    def may(self, right: Right, subject: str, group: str | None = None) -> bool:
        """Whether this token has ``right`` on ``subject`` (and ``group``, if one is named).

        With ``group=None`` the question is "on some group of the subject": listings use it.
        """
        if self.admin:
            return True
        scopes = {
            Right.PRODUCE: self.produce,
            Right.CONSUME: self.consume,
            Right.MANAGE: self.manage,
        }[right]
        return any(scope.covers(subject, group) for scope in scopes)

    def sees(self, subject: str, group: str | None = None) -> bool:
        """Whether a listing shows this subject (and group) to the token."""
        if group is None and self.may(Right.PRODUCE, subject):
            return True
        return self.may(Right.CONSUME, subject, group) or self.may(Right.MANAGE, subject, group)

    @property
    def manages_all(self) -> bool:
        """Broker-wide views (the delayed-message schedule) need ``manage`` on ``*``."""
        return self.admin or any(s.subject == "*" and s.groups is None for s in self.manage)


def _scopes(items: list[str | _GroupRight] | list[str]) -> tuple[Scope, ...]:
    return tuple(
        Scope(item) if isinstance(item, str) else Scope(item.subject, tuple(item.groups))
        for item in items
    )


class Authorizer:
    def __init__(self, grants: list[Grant]) -> None:
        self._grants = grants

    @classmethod
    def from_file(cls, path: Path) -> Authorizer:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"auth file {path}: {exc.strerror or exc}") from exc
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"auth file {path}: not JSON: {exc}") from exc
        try:
            parsed = _TokensFile.model_validate(doc)
        except ValidationError as exc:
            raise ConfigError(f"auth file {path}: {_first_problem(exc, doc)}") from None
        return cls(_grants(path, parsed))

    def grant_for(self, authorization: str | None) -> Grant:
        """The grant of a request's ``Authorization`` header; never raises but ``Denied``."""
        if not authorization or not authorization.startswith("Bearer "):
            raise Denied(code="unauthorized", message="a bearer token is required")
        # Header values arrive as latin-1 text; comparing bytes never raises on any input.
        token = authorization[len("Bearer ") :].strip().encode("utf-8", "surrogateescape")
        found: Grant | None = None
        for grant in self._grants:  # compare with every grant: no early exit to time
            if hmac.compare_digest(grant.token, token) and token:
                found = grant
        if found is None:
            raise Denied(code="unauthorized", message="unknown token")
        return found

    @staticmethod
    def require(
        grant: Grant, right: Right, subject: str, *, group: str | None = None, field: str
    ) -> None:
        if not grant.may(right, subject, group):
            target = f"{subject!r}" if group is None else f"{subject!r} group {group!r}"
            raise Denied(
                code="forbidden",
                message=f"token {grant.name!r} may not {right} on {target}",
                field=field,
            )


def _grants(path: Path, parsed: _TokensFile) -> list[Grant]:
    grants: list[Grant] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(parsed.tokens):
        if entry.token in seen:
            raise ConfigError(
                f"auth file {path}: tokens[{i}] ({entry.name!r}): the same token as "
                f"tokens[{seen[entry.token]}]"
            )
        seen[entry.token] = i
        grants.append(
            Grant(
                name=entry.name,
                token=entry.token.encode("ascii"),
                produce=_scopes(entry.produce),
                consume=_scopes(entry.consume),
                manage=_scopes(entry.manage),
                admin=entry.admin,
            )
        )
    return grants


def _first_problem(exc: ValidationError, doc: Any) -> str:
    """One line naming the entry and field of the first problem pydantic found."""
    errors = exc.errors()
    # A right is a pattern or an object: each union member reports its own error, and only
    # the one matching the value's type says something to a reader.
    relevant = [
        e
        for e in errors
        if not ("constrained-str" in e["loc"] and e["type"] == "string_type")
        and not ("_GroupRight" in e["loc"] and e["type"] == "model_type")
    ]
    error = (relevant or errors)[0]
    loc = [p for p in error["loc"] if p not in ("constrained-str", "_GroupRight")]
    where = ""
    if len(loc) >= 2 and loc[0] == "tokens" and isinstance(loc[1], int):
        index = loc[1]
        name = None
        try:
            name = doc["tokens"][index].get("name")
        except (KeyError, IndexError, TypeError, AttributeError):
            pass
        where = f"tokens[{index}]" + (f" ({name!r})" if isinstance(name, str) else "")
        loc = loc[2:]
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    message = str(error["msg"])
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    elif error["type"] == "string_pattern_mismatch" and path.endswith("token"):
        message = "must be 1 to 1024 printable ASCII characters without spaces"
    elif error["type"] == "string_pattern_mismatch":
        message = "must be a subject or group pattern (A-Za-z0-9._- and *?[]!)"
    elif not loc and not where:
        message = 'must be an object {"tokens": [...]}'
    return f"{': '.join(p for p in (where, path) if p) or 'file'}: {message}"
