"""URLs: a database URL's sync driver for tools that need one (migrations, the compensator),
and any URL as shown in logs and errors (its password masked)."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url

from qmq_cli.failures import mask_passwords as mask_passwords  # one rule for every line

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


def mask_url(url: str | URL) -> str:
    """``url`` with its password replaced by ``***``, parseable or not."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a SQLAlchemy URL
        return mask_passwords(url)
