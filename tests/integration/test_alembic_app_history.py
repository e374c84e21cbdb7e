"""docs/outbox.md, option B: the SDK's revisions inside an application's own Alembic history.

A small application (its own ``alembic.ini``, ``env.py`` and first revision) on a fresh
PostgreSQL database runs the documented commands with the ``alembic`` command line:
``upgrade heads``, ``revision --autogenerate --head app@head``, ``upgrade heads`` again,
and a downgrade of its own branch that leaves the SDK's tables alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from qmq_outbox import migrate
from tests.support.alembic_app import APP_ENV, APP_FIRST
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.timeout(120)

ALEMBIC_INI = """
[alembic]
script_location = %(here)s/migrations
path_separator = os
version_locations = %(here)s/migrations/versions{sep}{qmq_versions}
sqlalchemy.url = {url}
"""

MAKO = '''"""${message}"""
import sqlalchemy as sa
from alembic import op

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade():
    ${upgrades if upgrades else "pass"}


def downgrade():
    ${downgrades if downgrades else "pass"}
'''


@pytest.fixture
def app(tmp_path: Path, pg_admin_url: str) -> Iterator[tuple[Path, str]]:
    with fresh_database(pg_admin_url, prefix="qmq_app_history") as url:
        scripts = tmp_path / "migrations"
        (scripts / "versions").mkdir(parents=True)
        (scripts / "env.py").write_text(textwrap.dedent(APP_ENV))
        (scripts / "script.py.mako").write_text(MAKO)
        (scripts / "versions" / "app0001_orders.py").write_text(APP_FIRST)
        ini = ALEMBIC_INI.format(
            sep=os.pathsep, qmq_versions=migrate.versions_location(), url=url.replace("%", "%%")
        )
        (tmp_path / "alembic.ini").write_text(ini)
        yield tmp_path, url


def alembic(cwd: Path, *args: str, ok: bool = True) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = done.stdout + done.stderr
    assert (done.returncode == 0) == ok, output
    return output


def state(url: str) -> tuple[set[str], set[str]]:
    """The database's tables and the revisions in its ``alembic_version``."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            versions = {row[0] for row in conn.execute(sa.text("SELECT * FROM alembic_version"))}
        return set(sa.inspect(engine).get_table_names()), versions
    finally:
        engine.dispose()


def test_the_documented_commands_work_on_an_app_with_its_own_history(
    app: tuple[Path, str],
) -> None:
    cwd, url = app
    # Why the docs say "heads": the plain command refuses two branches.
    assert "Multiple head revisions" in alembic(cwd, "upgrade", "head", ok=False)

    alembic(cwd, "upgrade", "heads")
    tables, versions = state(url)
    assert tables == {"alembic_version", "orders", "qmq_outbox", "qmq_consumed"}
    assert versions == {"app0001", "qmq0003"}  # one table, one row per branch

    alembic(cwd, "revision", "--autogenerate", "--head", "app@head", "-m", "order note")
    (new,) = (cwd / "migrations" / "versions").glob("*order_note.py")
    script = new.read_text()
    assert "down_revision = 'app0001'" in script
    assert "op.add_column('orders', sa.Column('note'" in script
    assert "qmq_" not in script  # include_object: no drop of the SDK's tables proposed

    alembic(cwd, "upgrade", "heads")
    tables, versions = state(url)
    engine = sa.create_engine(url)
    try:
        assert "note" in {c["name"] for c in sa.inspect(engine).get_columns("orders")}
    finally:
        engine.dispose()
    assert len(versions) == 2
    assert "qmq0003" in versions

    # An autogenerate with nothing changed proposes nothing (the SDK's tables included).
    alembic(cwd, "revision", "--autogenerate", "--head", "app@head", "-m", "nothing")
    (empty,) = (cwd / "migrations" / "versions").glob("*nothing.py")
    assert "op." not in empty.read_text()

    alembic(cwd, "upgrade", "heads")
    alembic(cwd, "downgrade", "app@-1")  # the empty revision
    alembic(cwd, "downgrade", "app@-1")  # the note column
    assert state(url)[1] == {"app0001", "qmq0003"}
    alembic(cwd, "downgrade", "app@base")
    tables, versions = state(url)
    assert tables == {"alembic_version", "qmq_outbox", "qmq_consumed"}
    assert versions == {"qmq0003"}
