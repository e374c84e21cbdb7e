"""Producer-id dedup per subject in bounded memory: sorted run files behind a Bloom filter.

``store`` (``DedupStore``: the API the broker calls, its jobs and stats), ``runs`` (the run
files: layout, writing, merging, lookups), ``filter`` (the Bloom filter and ``filter.bin``).
"""

from qmq_broker.dedup.jobs import DedupJob
from qmq_broker.dedup.store import DedupStats, DedupStore

__all__ = ["DedupJob", "DedupStats", "DedupStore"]
