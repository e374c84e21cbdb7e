"""One local Spark session for the Spark tier (loopback only, no UI, small shuffles)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pyspark = pytest.importorskip("pyspark")

from pyspark.sql import SparkSession  # noqa: E402

from qmq_reconcile.session import build_session, default_jars, register  # noqa: E402


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = build_session(
        master="local[2]",
        jars=default_jars(),
        conf={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
    )
    register(session)
    yield session
    session.stop()
