"""Bringing a data directory to a consistent state: recovery on start, format migration,
index recovery and repair, and the offline ``verify`` and ``repair`` commands.

These know subjects, groups and dedup, so they sit above them; ``qmq_broker.storage`` holds
the disk primitives they stand on.
"""
