"""Fair pull scheduling: one actor per (subject, group), time-sliced by virtual runtime.

``actor`` holds a group's mailbox and parked long polls, ``scheduler`` decides which actor
a worker runs next (``fair`` or ``fifo``), ``clock`` makes time injectable for tests. The
threading model is described in ``scheduler``.
"""

from qmq_broker.clock import Clock, ManualClock, SystemClock
from qmq_broker.pulls.actor import PullActor, PullCounts
from qmq_broker.pulls.errors import DeadlineExceeded, MailboxFull, ShuttingDown, TooManyPulls
from qmq_broker.pulls.metrics import ActorMetrics
from qmq_broker.pulls.request import Processor, PullOutcome, QueuedPull, Served
from qmq_broker.pulls.scheduler import SCHEDULERS, FairScheduler, FifoScheduler, PullScheduler

__all__ = [
    "SCHEDULERS",
    "ActorMetrics",
    "Clock",
    "DeadlineExceeded",
    "FairScheduler",
    "FifoScheduler",
    "MailboxFull",
    "ManualClock",
    "Processor",
    "PullActor",
    "PullCounts",
    "PullOutcome",
    "PullScheduler",
    "QueuedPull",
    "Served",
    "ShuttingDown",
    "SystemClock",
    "TooManyPulls",
]
