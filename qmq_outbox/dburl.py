"""Database URLs: the sync driver for tools that need one (migrations, the compensator)."""

from __future__ import annotations

from sqlalchemy.engine import make_url

_SYNC_DRIVERS = {
    "sqlite+aiosqlite": "sqlite",
    "postgresql+asyncpg": "postgresql+psycopg",
    "postgresql+psycopg_async": "postgresql+psycopg",
}


def sync_database_url(url: str) -> str:
    """``url`` with an asyncio driver swapped for its blocking counterpart."""
    parsed = make_url(url)
    driver = _SYNC_DRIVERS.get(parsed.drivername)
    if driver is None:
        return url
    return parsed.set(drivername=driver).render_as_string(hide_password=False)
