"""Storage adapters: segment files, the group-commit journal, recovery and checkpoints."""
