"""Optional bearer-token auth with per-subject produce/consume rights from a JSON file.

File format::

    {"tokens": [{"name": "orders", "token": "s3cret", "produce": ["order.*"], "consume": []},
                {"name": "ops", "token": "...", "produce": ["*"], "consume": ["*"], "admin": true}]}

Patterns are shell-style (``fnmatch``). ``admin`` allows dead-letter redrive on any subject.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hmac
from pathlib import Path

import orjson

from broker.errors import ConfigError, Denied


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    name: str
    token: str
    produce: tuple[str, ...]
    consume: tuple[str, ...]
    admin: bool

    def may(self, right: str, subject: str) -> bool:
        if right == "admin":
            return self.admin
        patterns = self.produce if right == "produce" else self.consume
        return self.admin or any(fnmatch.fnmatchcase(subject, p) for p in patterns)


class Authorizer:
    def __init__(self, grants: list[Grant]) -> None:
        self._grants = grants

    @classmethod
    def from_file(cls, path: Path) -> Authorizer:
        try:
            doc = orjson.loads(path.read_bytes())
            grants = [
                Grant(
                    name=str(item.get("name", "token")),
                    token=str(item["token"]),
                    produce=tuple(item.get("produce", [])),
                    consume=tuple(item.get("consume", [])),
                    admin=bool(item.get("admin", False)),
                )
                for item in doc["tokens"]
            ]
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"auth file {path}: {exc}") from exc
        return cls(grants)

    def grant_for(self, authorization: str | None) -> Grant:
        if not authorization or not authorization.startswith("Bearer "):
            raise Denied(code="unauthorized", message="a bearer token is required")
        token = authorization[len("Bearer ") :].strip()
        for grant in self._grants:
            if hmac.compare_digest(grant.token, token):
                return grant
        raise Denied(code="unauthorized", message="unknown token")

    def check(self, authorization: str | None, right: str, subject: str, field: str) -> None:
        grant = self.grant_for(authorization)
        if not grant.may(right, subject):
            raise Denied(
                code="forbidden",
                message=f"token {grant.name!r} may not {right} on {subject!r}",
                field=field,
            )
