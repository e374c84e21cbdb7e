"""The driver JVM's class-data archive: which file, when it is written, when it is used
(pure file logic; the JVM side runs in every reconciliation of the acceptance tests)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from qmq_reconcile.jvm_archive import STALE_AFTER_S, Archive, fingerprint, prepare


def fake_install(tmp_path: Path) -> tuple[Path, Path]:
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_bytes(b"java")
    jars = tmp_path / "jars"
    jars.mkdir()
    (jars / "spark-core.jar").write_bytes(b"core")
    return java, jars


def test_no_archive_yet_means_writing_one_under_a_temporary_name(tmp_path: Path) -> None:
    java, jars = fake_install(tmp_path)
    archive = prepare(tmp_path / "cache", java=java, spark_jars=jars)
    assert archive is not None
    assert archive.writing is not None
    assert archive.path.parent == tmp_path / "cache"
    assert archive.writing.name.startswith(archive.path.name)
    assert f"-XX:ArchiveClassesAtExit={archive.writing}" in archive.java_options
    assert "-Xlog:cds=off" in archive.java_options  # a foreign archive is ignored quietly
    assert not archive.publish()  # the JVM wrote nothing: nothing to put in place
    archive.writing.write_bytes(b"archive")  # what the JVM writes as it exits
    assert archive.publish()
    assert archive.path.read_bytes() == b"archive"
    again = prepare(tmp_path / "cache", java=java, spark_jars=jars)
    assert again == Archive(path=archive.path)
    assert f"-XX:SharedArchiveFile={archive.path}" in again.java_options


def test_a_new_java_or_new_jars_need_a_new_archive(tmp_path: Path) -> None:
    java, jars = fake_install(tmp_path)
    first = fingerprint(java, jars)
    (jars / "spark-sql.jar").write_bytes(b"sql")
    second = fingerprint(java, jars)
    java.write_bytes(b"java 21")
    third = fingerprint(java, jars)
    assert len({first, second, third}) == 3


def test_half_written_and_stale_archives_are_removed(tmp_path: Path) -> None:
    java, jars = fake_install(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / "spark-0000.jsa.1.tmp"
    stale.write_bytes(b"left by a killed run")
    old = time.time() - STALE_AFTER_S - 60
    os.utime(stale, (old, old))
    fresh = cache / "spark-0000.jsa.2.tmp"
    fresh.write_bytes(b"another run writing now")
    archive = prepare(cache, java=java, spark_jars=jars)
    assert archive is not None
    assert archive.writing is not None
    assert not stale.exists()
    assert fresh.exists()
    archive.writing.write_bytes(b"cut short")
    archive.discard()
    assert not archive.writing.exists()
    assert not archive.path.exists()


def test_a_cache_that_cannot_be_written_means_no_archive(tmp_path: Path) -> None:
    java, jars = fake_install(tmp_path)
    blocked = tmp_path / "file"
    blocked.write_bytes(b"")
    assert prepare(blocked / "cache", java=java, spark_jars=jars) is None
