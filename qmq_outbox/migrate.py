"""Run the SDK's Alembic migrations (``qmq_outbox/migrations/``) from Python.

``upgrade(url)`` / ``downgrade(url, revision)`` take a database URL or an open
``Connection`` (then they run inside the caller's transaction and leave committing to it).
History is kept in ``qmq_alembic_version``, apart from the application's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection

from qmq_outbox.dburl import sync_database_url
from qmq_outbox.errors import ConfigurationError

VERSION_TABLE = "qmq_alembic_version"
TABLES = frozenset({"qmq_outbox", "qmq_consumed", VERSION_TABLE})
_MARKER = "env.py"


def script_location() -> Path:
    """The Alembic script directory shipped inside the package (``qmq_outbox/migrations/``)."""
    location = Path(__file__).resolve().parent / "migrations"
    if (location / _MARKER).is_file():
        return location
    raise ConfigurationError("the qmq-outbox migrations directory is not installed")


def versions_location() -> Path:
    """For ``version_locations`` in an application's own alembic.ini (branch ``qmq``)."""
    return script_location() / "versions"


def alembic_config(target: str | Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.set_main_option("path_separator", "os")
    if isinstance(target, Connection):
        config.attributes["connection"] = target
    else:
        config.attributes["url"] = sync_database_url(target)
    return config


def upgrade(target: str | Connection, revision: str = "head") -> None:
    """Migrate the SDK's tables up to ``revision``."""
    command.upgrade(alembic_config(target), revision)


def downgrade(target: str | Connection, revision: str) -> None:
    """Migrate the SDK's tables down to ``revision`` (``"base"`` drops them)."""
    command.downgrade(alembic_config(target), revision)


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """For an application's ``context.configure(include_object=...)``: keeps its
    autogenerate from proposing to drop the SDK's tables (they are not in its metadata)."""
    table = getattr(obj, "table", None)
    table_name = name if type_ == "table" else getattr(table, "name", None)
    return table_name not in TABLES
