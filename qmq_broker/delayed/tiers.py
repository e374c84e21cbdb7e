"""Which schedule bucket a delayed message goes to, and when a coarse bucket is moved on.

Hour buckets alone cost one file per occupied hour: a message an hour for two years made
17,400 files of one record each (a disk block apiece). So a message due far ahead goes to
the coarsest bucket whose time has not come (32 days, else a UTC day, else its hour), and
a coarse bucket is moved into the next finer buckets shortly before the first of them is
needed: a day ``load_ahead`` plus an hour before it begins (its first hour is loaded into
the wheel ``load_ahead`` before it begins), a 32-day span ``load_ahead`` plus a day before
(its first day is moved an hour before that). These are the overflow wheels of a
hierarchical timing wheel, on disk. A message due before the next day's move (about
11 pm UTC with the default load-ahead) goes straight to its hour and is never moved.

Pure: the clock reading and what is already being moved are passed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from qmq_broker.format.files import SegmentKind
from qmq_broker.format.schedule import (
    COARSE_SCHEDULE_KINDS,
    SCHEDULE_KINDS,
    bucket_start_us,
    bucket_width_us,
    schedule_bucket,
)
from qmq_broker.storage.buckets import BucketKey


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tiers:
    """Bucket placement for one broker; ``load_ahead_us`` as the scheduler's."""

    load_ahead_us: int

    def move_at_us(self, kind: SegmentKind, bucket: int) -> int:
        """When a coarse bucket is moved into the next finer ones."""
        finer = SCHEDULE_KINDS[SCHEDULE_KINDS.index(kind) - 1]
        return bucket_start_us(kind, bucket) - self.load_ahead_us - bucket_width_us(finer)

    def place(
        self, deliver_at_us: int, *, now_us: int, moving_through: Mapping[SegmentKind, int]
    ) -> BucketKey:
        """The bucket a record due at ``deliver_at_us`` is appended to at ``now_us``.

        ``moving_through[kind]`` is the highest bucket of ``kind`` whose move has begun:
        nothing more may be appended to it (or to one before it).
        """
        for kind in reversed(COARSE_SCHEDULE_KINDS):
            bucket = schedule_bucket(kind, deliver_at_us)
            if bucket > moving_through.get(kind, -1) and now_us < self.move_at_us(kind, bucket):
                return kind, bucket
        return SegmentKind.SCHEDULE, schedule_bucket(SegmentKind.SCHEDULE, deliver_at_us)
