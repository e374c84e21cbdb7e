"""A fresh PostgreSQL database for one benchmark run, dropped when it ends."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.engine import make_url


@contextmanager
def fresh_database(
    admin_url: str, *, prefix: str, tables: Sequence[sa.MetaData] = ()
) -> Iterator[str]:
    """A new database named ``<prefix>_<random>`` holding ``tables``; its URL. ``admin_url``
    runs the CREATE and the DROP (``WITH (FORCE)``: a run's stray connections do not keep
    it)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        if tables:
            engine = sa.create_engine(url)
            for metadata in tables:
                metadata.create_all(engine)
            engine.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
