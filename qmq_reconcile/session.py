"""Starting the Spark session the reconciliation runs in (driver jars, logging, registration)
and stopping it.

JDBC drivers come from Debian's ``libpostgresql-jdbc-java`` and ``libxerial-sqlite-jdbc-java``
(``/usr/share/java``) unless jars are given explicitly; nothing is fetched from the network
(``spark.jars.packages`` is never used). On a cluster, pass the driver jars with ``jars``
(the CLI's ``--jars`` / ``QMQ_RECONCILE_JARS``): Spark ships ``spark.jars`` to the executors.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from pyspark import SparkContext
from pyspark.find_spark_home import _find_spark_home
from pyspark.sql import SparkSession

from qmq_reconcile import jvm_archive
from qmq_reconcile.datasource import QmqLogDataSource
from qmq_reconcile.errors import UnreadablePath

DEBIAN_JARS = ("/usr/share/java/postgresql.jar", "/usr/share/java/sqlite-jdbc.jar")
APP_NAME = "qmq-reconcile"
JVM_EXIT_TIMEOUT_S = 120.0  # writing the class archive at exit takes a few seconds
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


def local_conf(master: str, *, small: bool = False) -> dict[str, str]:
    """Settings for ``local[...]`` masters: loopback only, no UI, few shuffle partitions,
    uncompressed caches, the throughput collector, and the JIT and code generation tuned
    to the run's size (``small``: seconds of work)."""
    if not master.startswith("local"):
        return {}
    # The parallel collector: the JVM's default (G1) spends a core of two on concurrent
    # work while a million records are cached and shuffled.
    java = ["-XX:+UseParallelGC"]
    small_run: dict[str, str] = {}
    if small:
        # C2 and Janino (each query's generated code) cost more CPU seconds than a small
        # run has work; at a million records C2 earns it back (classification twice as
        # fast). Spark's interpreted evaluation (the setting its own tests use to run it)
        # is plenty for this much data.
        java.append("-XX:TieredStopAtLevel=1")
        small_run["spark.sql.codegen.wholeStage"] = "false"
        small_run["spark.sql.codegen.factoryMode"] = "NO_CODEGEN"
    else:
        # C2 compiles what runs 5,000 times: over a run's few dozen queries that is mostly
        # Janino, ASM and serialization, 70 CPU seconds at a million records. Ten times the
        # thresholds leaves C2 to the loops over the records (a third less CPU in all).
        # The compilers still took 15 of a run's 57 JVM CPU-seconds; C2 inlining hot callees
        # of up to 100 bytecodes instead of 325 cut that to 12 with the executors' time
        # unchanged (the generated loops' callees are small).
        java += [
            "-XX:Tier4InvocationThreshold=50000",
            "-XX:Tier4MinInvocationThreshold=6000",
            "-XX:Tier4CompileThreshold=150000",
            "-XX:Tier4BackEdgeThreshold=400000",
            "-XX:FreqInlineSize=100",
        ]
    conf = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        # Executors share the driver's JVM in local mode; 1g (Spark's default) makes a
        # million cached records spend their time in garbage collection.
        "spark.driver.memory": "4g",
        "spark.driver.extraJavaOptions": " ".join(java),
        "spark.sql.shuffle.partitions": "8",
        # The cached inputs stay uncompressed: finding each column's encoding copies
        # every string of it (ids and hashes are all distinct, so no encoding pays), a
        # tenth of a million-record run's CPU; uncompressed they take about 0.5 GB.
        "spark.sql.inMemoryColumnarStorage.compressed": "false",
        **small_run,
    }
    return conf


def build_session(
    *,
    master: str,
    jars: Sequence[str],
    conf: Mapping[str, str] | None = None,
    quiet: bool = True,
    jvm_log: Path | None = None,
    archive: jvm_archive.Archive | None = None,
    small: bool = False,
) -> SparkSession:
    """A new session with the JDBC jars on its classpath (``qmq-log`` is not registered:
    ``readers.read_broker`` does that when it needs it, ``register`` when you do).

    ``quiet``: the JVM logs errors only. ``jvm_log``: the JVM (and the Python workers it
    starts) write their console output to this file instead of this process's stderr.
    ``archive``: the driver JVM maps its classes from this class-data archive, or writes it
    (``class_archive``; then stop the session with ``stop_session``). ``small``: tune a
    local session for a run of seconds (``local_conf``).
    """
    settings = {
        "spark.sql.session.timeZone": "UTC",
        # Grouping a million distinct message ids: the object hash aggregate falls back
        # to sorting after 128 keys anyway, and costs more than sorting from the start.
        "spark.sql.execution.useObjectHashAggregateExec": "false",
        # Categories are written with partitionBy: concurrent writers instead of a sort.
        "spark.sql.maxConcurrentOutputFileWriters": "16",
        **local_conf(master, small=small),
        **(conf or {}),
    }
    if jars:
        settings["spark.jars"] = ",".join(jars)
    extra = settings.get("spark.driver.extraJavaOptions", "")
    if quiet and "log4j2.configurationFile" not in extra:
        extra += f" -Dlog4j2.configurationFile=file:{_quiet_log_config()}"
    if archive is not None:
        extra += f" {archive.java_options}"
    if extra.strip():
        settings["spark.driver.extraJavaOptions"] = extra.strip()
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


def default_jvm_cache() -> Path | None:
    """``~/.cache/qmq-reconcile``, where the class-data archive is kept by default."""
    try:
        return Path.home() / ".cache" / "qmq-reconcile"
    except RuntimeError:  # no home directory
        return None


def class_archive(cache_dir: Path) -> jvm_archive.Archive | None:
    """The class-data archive for the ``java`` and the Spark jars that ``spark-submit``
    will use (``qmq_reconcile.jvm_archive``), kept in ``cache_dir``; ``None`` when there
    is no ``java`` to fingerprint or the directory cannot be written."""
    java = jvm_archive.find_java(os.environ.get("JAVA_HOME"))
    jars = Path(_find_spark_home()) / "jars"
    if java is None or not jars.is_dir():
        return None
    return jvm_archive.prepare(cache_dir, java=java, spark_jars=jars)


def stop_session(spark: SparkSession, archive: jvm_archive.Archive | None = None) -> None:
    """Stop ``spark``. When its JVM writes ``archive``, also let that JVM exit (it writes
    the archive as it does) and put the archive in place; the next session starts a new
    JVM."""
    spark.stop()
    if archive is None or archive.writing is None:
        return
    gateway = SparkContext._gateway
    if gateway is not None:
        process: subprocess.Popen[bytes] | None = getattr(gateway, "proc", None)
        gateway.shutdown()
        SparkContext._gateway = None
        SparkContext._jvm = None
        if process is not None and not _exited(process):
            archive.discard()
            return
    archive.publish()


def _exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether the gateway JVM exited on its own once its stdin ended (killed otherwise)."""
    if process.stdin is not None:
        process.stdin.close()
    try:
        return process.wait(JVM_EXIT_TIMEOUT_S) == 0
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False


def is_local(master: str | None) -> bool:
    """Whether ``master`` (a master URL, or ``SparkContext.master``) runs in this machine."""
    return (master or "").startswith("local")


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("qmq-log")`` available in ``spark``."""
    spark.dataSource.register(QmqLogDataSource)
