"""The Alembic revisions create exactly ``qmq_outbox.schema.metadata`` (PostgreSQL, SQLite)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from click.testing import CliRunner

from qmq_cli.main import main
from qmq_outbox import migrate
from qmq_outbox.schema import metadata
from tests.support.alembic_app import APP_ENV, APP_FIRST
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.timeout(120)
QMQ_TABLES = {"qmq_outbox", "qmq_consumed"}


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'm.db'}"
        return
    admin: str = request.getfixturevalue("pg_admin_url")
    with fresh_database(admin, prefix="qmq_migrations") as pg:
        yield pg


def diff(url: str) -> list[object]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    "compare_server_default": True,
                    "version_table": migrate.VERSION_TABLE,
                },
            )
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_matches_metadata_and_downgrade_removes_it(url: str) -> None:
    migrate.upgrade(url)
    assert tables(url) == QMQ_TABLES | {migrate.VERSION_TABLE}
    assert diff(url) == []
    migrate.downgrade(url, "base")
    assert tables(url) == {migrate.VERSION_TABLE}
    changes = diff(url)
    assert {c[0] for c in changes} == {"add_table", "add_index"}  # type: ignore[index]
    assert {c[1].name for c in changes if c[0] == "add_table"} == QMQ_TABLES  # type: ignore[index]
    migrate.upgrade(url)
    assert diff(url) == []


def test_qmq0003_adds_tags_to_existing_rows_as_none_and_downgrades(url: str) -> None:
    migrate.upgrade(url, "qmq0002")
    row = {
        "message_id": "m-1",
        "subject": "orders",
        "headers": "{}",
        "body": b"{}",
        "content_type": "application/json",
        "next_attempt_at": "2026-11-28 10:00:00+00:00",
        "created_at": "2026-11-28 10:00:00+00:00",
    }
    names = ", ".join(row)
    insert = sa.text(f"INSERT INTO qmq_outbox ({names}) VALUES (:{', :'.join(row)})")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(insert, row)
        migrate.upgrade(url)
        assert diff(url) == []
        outbox = metadata.tables["qmq_outbox"]
        with engine.begin() as conn:
            assert conn.execute(sa.select(outbox.c.tags)).scalar_one() is None
            conn.execute(
                outbox.update().where(outbox.c.message_id == "m-1").values(tags=["a", "b"])
            )
            assert conn.execute(sa.select(outbox.c.tags)).scalar_one() == ["a", "b"]
        migrate.downgrade(url, "qmq0002")
        columns = {c["name"] for c in sa.inspect(engine).get_columns("qmq_outbox")}
        assert "tags" not in columns
        assert "message_id" in columns
    finally:
        engine.dispose()


def test_cli_upgrade_and_downgrade(url: str) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["db", "upgrade"], env={"QMQ_DB_DATABASE_URL": url})
    assert result.exit_code == 0, result.output
    assert tables(url) >= QMQ_TABLES
    result = runner.invoke(main, ["db", "downgrade", "--database-url", url, "--revision", "base"])
    assert result.exit_code == 0, result.output
    assert not QMQ_TABLES & tables(url)
    result = runner.invoke(main, ["db", "downgrade", "--database-url", url])
    assert result.exit_code == 2
    assert "--revision" in result.output


def test_upgrade_inside_the_callers_transaction(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'c.db'}")
    with engine.begin() as conn:
        migrate.upgrade(conn)
        assert set(sa.inspect(conn).get_table_names()) >= QMQ_TABLES
    engine.dispose()


def test_async_driver_urls_are_migrated_with_the_sync_driver(tmp_path: Path) -> None:
    migrate.upgrade(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")
    assert tables(f"sqlite:///{tmp_path / 'a.db'}") >= QMQ_TABLES


def test_script_location_is_packaged() -> None:
    location = migrate.script_location()
    assert (location / "env.py").is_file()
    assert (location / "script.py.mako").is_file()
    assert list((location / "versions").glob("qmq0001_*.py"))


def test_revisions_join_an_applications_history(tmp_path: Path) -> None:
    """docs/outbox.md, option B: the SDK's versions in the app's ``version_locations``."""
    app = tmp_path / "alembic"
    (app / "versions").mkdir(parents=True)
    (app / "env.py").write_text(textwrap.dedent(APP_ENV))
    (app / "versions" / "app0001_orders.py").write_text(textwrap.dedent(APP_FIRST))
    (app / "script.py.mako").write_text("")
    url = f"sqlite:///{tmp_path / 'app.db'}"
    config = Config()
    config.set_main_option("script_location", str(app))
    config.set_main_option("path_separator", "os")
    locations = os.pathsep.join([str(app / "versions"), str(migrate.versions_location())])
    config.set_main_option("version_locations", locations)
    config.set_main_option("sqlalchemy.url", url)
    command.upgrade(config, "heads")
    assert tables(url) == {"orders", "alembic_version"} | QMQ_TABLES
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        context = MigrationContext.configure(conn)
        assert set(context.get_current_heads()) == {"app0001", "qmq0003"}
        app_metadata = sa.MetaData()
        sa.Table("orders", app_metadata, sa.Column("id", sa.Integer, primary_key=True))
        filtered = MigrationContext.configure(conn, opts={"include_object": migrate.include_object})
        assert compare_metadata(filtered, app_metadata) == []  # no "drop qmq_outbox" proposed
    engine.dispose()
