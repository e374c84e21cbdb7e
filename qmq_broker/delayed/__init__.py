"""Delayed and scheduled messages (docs/architecture.md, section 3.2, after QMQ's delay server).

A message whose ``deliver_at`` lies in the future is answered ``scheduled`` and framed,
whole, into the schedule segment of its due hour. Shortly before an hour begins its
segment is read into an in-memory timing wheel of 500 ms slots; when a message comes due
it is stored in its subject through the ordinary produce path (same id, so dedup holds),
and its offset is written to the hour's dispatch segment. After a crash the dispatch
segment says what already went out; a dispatch whose record was lost is caught by the
subject's id dedup and not stored twice.

Messages due after the current UTC day wait in coarser buckets (a UTC day, 32 days) and are
moved into finer ones before their time comes, so a sparse schedule costs a file per
occupied day or 32 days, not per hour.

Modules: ``idset`` (compact 64-bit hash set of scheduled ids), ``wheel`` (the timing
wheel), ``tiers`` (which bucket a message goes to, when a coarse one is moved), ``scan``
(reading bucket segments), ``recovery`` (startup scan), ``service`` (orchestration and the
supervised loop), ``metrics``.
"""
