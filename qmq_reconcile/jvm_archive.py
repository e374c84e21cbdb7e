"""A class-data archive for the driver JVM, so that Spark starts in seconds, not tens of them.

Most of a local session's start-up is the JVM loading, verifying and linking Spark's classes
one by one. The JDK can map them from an archive instead (class-data sharing,
``-XX:SharedArchiveFile``). The first run with a given Java and Spark writes the archive
when its JVM exits (``-XX:ArchiveClassesAtExit``: a few seconds more, once, about 160 MB);
later runs use it. The archive's name carries a fingerprint of the ``java`` binary and of
Spark's jars, so an upgrade of either starts a new one; an archive the JVM cannot use is
ignored by the JVM (CDS logging is turned off, so it says nothing).

The JVM writes to a temporary name; ``Archive.publish`` renames it once the JVM has exited,
so a run never maps a half-written archive.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

STALE_AFTER_S = 3600.0  # a temporary archive this old was left by a run that was killed
_QUIET = "-Xlog:cds=off,cds+dynamic=off"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Archive:
    """The archive a session maps (``path`` exists) or writes (``writing`` is set)."""

    path: Path
    writing: Path | None = None

    @property
    def java_options(self) -> str:
        """The driver JVM options that map or write the archive."""
        if self.writing is not None:
            return f"{_QUIET} -XX:ArchiveClassesAtExit={self.writing}"
        return f"{_QUIET} -XX:SharedArchiveFile={self.path}"

    def publish(self) -> bool:
        """Put a written archive in place (after its JVM exited); whether there was one."""
        if self.writing is None or not self.writing.is_file():
            return False
        try:
            os.replace(self.writing, self.path)
        except OSError as exc:
            logger.warning(
                "the JVM class archive could not be saved",
                extra={"action": "reconcile.jvm_archive_failed", "error": str(exc)},
            )
            return False
        return True

    def discard(self) -> None:
        """Remove what a JVM that did not exit cleanly may have half written."""
        if self.writing is not None:
            self.writing.unlink(missing_ok=True)


def fingerprint(java: Path, spark_jars: Path) -> str:
    """What the archive depends on: the ``java`` binary and the jars on Spark's classpath."""
    digest = hashlib.sha256()
    for path in (java, *sorted(spark_jars.glob("*.jar"))):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def find_java(java_home: str | None) -> Path | None:
    """The ``java`` that ``spark-submit`` runs: ``$JAVA_HOME/bin/java``, else the PATH's."""
    found = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    return Path(found).resolve() if found else None


def prepare(cache_dir: Path, *, java: Path, spark_jars: Path) -> Archive | None:
    """The archive to map, or one to write when there is none yet; ``None`` when the cache
    directory cannot be written (the run then starts without an archive)."""
    try:
        name = f"spark-{fingerprint(java, spark_jars)}.jsa"
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / name
        if path.is_file():
            return Archive(path=path)
        _drop_stale(cache_dir)
        writing = cache_dir / f"{name}.{os.getpid()}.tmp"
        writing.touch()
        writing.unlink()
    except OSError as exc:
        logger.info(
            "no JVM class archive",
            extra={"action": "reconcile.jvm_archive_skipped", "error": str(exc)},
        )
        return None
    return Archive(path=path, writing=writing)


def _drop_stale(cache_dir: Path) -> None:
    now = time.time()
    for leftover in cache_dir.glob("spark-*.tmp"):
        try:
            if now - leftover.stat().st_mtime > STALE_AFTER_S:
                leftover.unlink()
        except OSError:
            pass  # another run's, or already gone
