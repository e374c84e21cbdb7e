"""Starting the Spark session the reconciliation runs in (driver jars, logging, registration).

JDBC drivers come from Debian's ``libpostgresql-jdbc-java`` and ``libxerial-sqlite-jdbc-java``
(``/usr/share/java``) unless jars are given explicitly; nothing is fetched from the network
(``spark.jars.packages`` is never used). On a cluster, pass the driver jars with ``jars``
(the CLI's ``--jars`` / ``QMQ_RECONCILE_JARS``): Spark ships ``spark.jars`` to the executors.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from pyspark.sql import SparkSession

from spark_reconcile.datasource import QmqLogDataSource
from spark_reconcile.errors import UnreadablePath

DEBIAN_JARS = ("/usr/share/java/postgresql.jar", "/usr/share/java/sqlite-jdbc.jar")
APP_NAME = "qmq-reconcile"
PANDAS_WARNING = r"PySpark does not yet fully support pandas"

# Spark's default log4j profile prints INFO/WARN chatter on stderr; the CLI keeps stderr for
# the one line that says what went wrong.
_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def default_jars() -> list[str]:
    """The Debian JDBC driver jars that are installed."""
    return [jar for jar in DEBIAN_JARS if Path(jar).is_file()]


def check_jars(jars: Sequence[str]) -> list[str]:
    """Local jar paths must exist; URLs (hdfs://, s3a://, ...) are left to Spark."""
    for jar in jars:
        if "://" not in jar and not Path(jar).is_file():
            raise UnreadablePath(f"JDBC driver jar {jar} does not exist")
    return list(jars)


def _quiet_log_config() -> str:
    path = Path(tempfile.gettempdir()) / "qmq-reconcile-log4j2.properties"
    if not path.exists() or path.read_text() != _LOG4J2:
        path.write_text(_LOG4J2)
    return str(path)


def local_conf(master: str) -> dict[str, str]:
    """Settings for ``local[...]`` masters: loopback only, no UI, few shuffle partitions."""
    if not master.startswith("local"):
        return {}
    conf = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        # Executors share the driver's JVM in local mode; 1g (Spark's default) makes a
        # million cached records spend their time in garbage collection.
        "spark.driver.memory": "4g",
        "spark.sql.shuffle.partitions": "8",
    }
    return conf


def build_session(
    *,
    master: str,
    jars: Sequence[str],
    conf: Mapping[str, str] | None = None,
    quiet: bool = True,
    jvm_log: Path | None = None,
) -> SparkSession:
    """A new session with the JDBC jars on its classpath and ``qmq-log`` registered.

    ``quiet``: the JVM logs errors only. ``jvm_log``: the JVM (and the Python workers it
    starts) write their console output to this file instead of this process's stderr.
    """
    settings = {
        "spark.sql.session.timeZone": "UTC",
        # Grouping a million distinct message ids: the object hash aggregate falls back
        # to sorting after 128 keys anyway, and costs more than sorting from the start.
        "spark.sql.execution.useObjectHashAggregateExec": "false",
        # Categories are written with partitionBy: concurrent writers instead of a sort.
        "spark.sql.maxConcurrentOutputFileWriters": "16",
        **local_conf(master),
        **(conf or {}),
    }
    if jars:
        settings["spark.jars"] = ",".join(jars)
    extra = settings.get("spark.driver.extraJavaOptions", "")
    if quiet and "log4j2.configurationFile" not in extra:
        option = f"-Dlog4j2.configurationFile=file:{_quiet_log_config()}"
        settings["spark.driver.extraJavaOptions"] = f"{extra} {option}".strip()
    if master.startswith("local"):
        # Python workers (data source, UDFs) run this interpreter, where the project is
        # installed; PySpark would otherwise start whatever ``python3`` is on the PATH.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(APP_NAME)
    for key, value in settings.items():
        builder = builder.config(key, value)
    with warnings.catch_warnings():
        # PySpark warns once per process that it does not fully support pandas 3; the
        # reconciliation uses no pandas conversion.
        warnings.filterwarnings("ignore", PANDAS_WARNING, FutureWarning)
        with _stderr_to(jvm_log) if jvm_log is not None else contextlib.nullcontext():
            spark = builder.getOrCreate()
    if quiet:
        spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at ``path`` while a child process (the JVM) is started."""
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("qmq-log")`` available in ``spark``."""
    spark.dataSource.register(QmqLogDataSource)
