"""Disk primitives: segment files, the group-commit journal, index files, checkpoints,
schedule buckets, fsync and the data directory lock."""
