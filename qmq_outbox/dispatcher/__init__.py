"""Send committed messages to the broker in the background and mark their rows ``sent``.

``Dispatch`` is the logic, without I/O (nor knowledge of the transport): a bounded backlog
fed by ``submit()``, which never blocks (when the backlog is full the messages are left to
the compensator: their rows stay ``pending``), the batches to send, and what to do with
each send's report. Two drivers run it:
``ThreadDispatcher`` (named daemon threads) for sync engines and ``AsyncDispatcher`` (named
tasks on the application's event loop) for asyncio engines. Rows are marked on the
dispatcher's own connections, never the caller's. An unavailable broker, or a database
where rows cannot be marked, is logged once when it starts failing, summarised while it
lasts and logged once when it recovers (``FailureLog``); after each failed send the breaker
stays open a little longer (jittered). A broker refusing the request as such (401, 403, a
wrong route: a configuration error) counts as unavailable: no row goes ``dead`` for it.

While the breaker is open the dispatcher keeps what it holds (the failed send's messages
and those committed meanwhile) and sends them when it closes again, as long as they are
younger than ``retry_for`` seconds: kept below the compensator's grace, the compensator
never sends a row the dispatcher may still send. Older ones are left to the compensator.
A message no queue takes (``unroutable``) is left to the compensator at once.

Keyed messages keep their key's order (docs/outbox.md, "Per-key order"). Each sender owns
a lane, and a (subject, key) always goes to the same lane (``KeyLanes``), so this
dispatcher never has one key in two sends at once. Before a send, the store's
``order_check`` says which keyed rows may go: those with no earlier unsent row of their key
outside the send; they go in outbox id order. A row held back (its earlier row is still
being sent elsewhere, or its commit's hand-off has not arrived yet) waits in its lane and is
tried again after ``hold_delay`` seconds, doubling, ``max_holds`` times; then it is left to
the compensator. Unkeyed messages share one backlog that every sender takes from, as before.

``ThreadDispatcher`` marks a send of unkeyed messages sent off the senders' path: a marker
thread (``Marks``) gathers their ids for up to ``mark_interval`` seconds (or ``MARK_BATCH``
ids) and marks them in one UPDATE per engine, and flushes what it holds at ``close()``.
Meanwhile those rows read ``pending`` (to the compensator, whose grace is far longer, and to
``qmq outbox status``). A send with keyed or rejected messages is marked at once: a key's
next row waits for its earlier one to read ``sent``.
"""

from qmq_outbox.dispatcher.aio import AsyncDispatcher
from qmq_outbox.dispatcher.core import HOLD_DELAY, MAX_HOLDS, Dispatch
from qmq_outbox.dispatcher.driver import DEFAULT_NAME
from qmq_outbox.dispatcher.queues import Backlog, Batch, Keyed, KeyLanes, Send, by_engine
from qmq_outbox.dispatcher.threads import MARK_BATCH, MARK_INTERVAL, Marks, ThreadDispatcher

__all__ = [
    "DEFAULT_NAME",
    "HOLD_DELAY",
    "MARK_BATCH",
    "MARK_INTERVAL",
    "MAX_HOLDS",
    "AsyncDispatcher",
    "Backlog",
    "Batch",
    "Dispatch",
    "KeyLanes",
    "Keyed",
    "Marks",
    "Send",
    "ThreadDispatcher",
    "by_engine",
]
