"""Fair pull scheduling: one actor per (subject, group), time-sliced by virtual runtime.

``actor`` holds a group's mailbox and parked long polls, ``scheduler`` decides which actor
a worker runs next (``fair`` or ``fifo``), ``clock`` makes time injectable for tests. The
threading model is described in ``scheduler``.
"""

from broker.scheduling.actor import PullActor
from broker.scheduling.clock import Clock, LoopClock, ManualClock
from broker.scheduling.errors import DeadlineExceeded, MailboxFull, ShuttingDown
from broker.scheduling.metrics import ActorMetrics
from broker.scheduling.request import Outcome, Processor, PullRequest
from broker.scheduling.scheduler import SCHEDULERS, FairScheduler, FifoScheduler, Scheduler

__all__ = [
    "SCHEDULERS",
    "ActorMetrics",
    "Clock",
    "DeadlineExceeded",
    "FairScheduler",
    "FifoScheduler",
    "LoopClock",
    "MailboxFull",
    "ManualClock",
    "Outcome",
    "Processor",
    "PullActor",
    "PullRequest",
    "Scheduler",
    "ShuttingDown",
]
