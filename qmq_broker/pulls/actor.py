"""One actor per (subject, group): a bounded mailbox of pulls and the long polls it parked.

The mailbox holds requests waiting for a worker. A request that found nothing is *parked*
(per delivery-state key, oldest first) and costs no worker time until one of three things
resumes it: new data for the group (``wake_data``: the oldest parked request of each key
goes back to the front of the mailbox; if it gets messages, the next one follows, so one
message does not stampede a thousand waiters), its own wait running out
(``wake_timeouts``: it is answered, empty if nothing came), or shutdown. An actor with
parked requests and nothing else to do is *suspended*.

The actor holds no scheduling policy: the scheduler decides when it runs, and for how long.
Every actor of a scheduler also keeps one shared ``PullCounts`` up to date, which is what
the broker-wide cap on pending pulls reads. Everything here runs on the event loop.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from qmq_broker.pulls.request import PullStatus, QueuedPull

if TYPE_CHECKING:
    from qmq_broker.clock import Timer
    from qmq_broker.pulls.metrics import ActorSeries

_ORDER = itertools.count()


@dataclasses.dataclass(slots=True)
class PullCounts:
    """Pulls not answered yet, summed over the actors that share this record.

    ``pending``: queued, running or parked; ``parked``: the long polls among them.
    """

    pending: int = 0
    parked: int = 0


class PullActor:
    """Mailbox, parked long polls and accounting of one (subject, group)."""

    def __init__(
        self,
        subject: str,
        group: str,
        *,
        capacity: int,
        totals: PullCounts,
        series: ActorSeries | None = None,
    ) -> None:
        self.subject = subject
        self.group = group
        self.capacity = capacity
        self.series = series
        self.totals = totals  # the scheduler's, shared by all its actors
        self.mailbox: deque[QueuedPull] = deque()
        self.pending = 0  # requests not answered yet: queued, running or parked
        self.parked_count = 0
        self._parked: dict[str, deque[QueuedPull]] = {}
        self._timeouts: list[tuple[float, int, QueuedPull]] = []
        self.empty_keys: set[str] = set()  # keys that found nothing since the last wake
        self.wake_at: float | None = None  # the group has something due then (retry, lease)
        self.timer: Timer | None = None
        self.timer_at: float | None = None
        # scheduling state, owned by the scheduler
        self.running = 0  # workers serving this actor right now
        self.runnable = False  # in the fair run queue
        self.vruntime = 0.0
        self.submitted_at = 0.0
        self.present_until = 0.0  # served moments ago: its consumers are about to pull again
        # accounting
        self.runs = 0
        self.service_s = 0.0  # wall time of its runs
        self.work_s = 0.0  # CPU its runs' requests cost (what its virtual runtime counts)
        self.suspended_s = 0.0
        self.suspended_since: float | None = None
        self.expired = 0
        self.rejected = 0
        self.charged_s = 0.0  # work done for its requests outside its runs (see ``charge``)
        self.cost_per_request: float | None = None  # recent seconds per served request
        self.charge_per_request: float | None = None  # recent seconds outside its runs, each

    def __repr__(self) -> str:
        return (
            f"PullActor({self.subject!r}, {self.group!r}, vruntime={self.vruntime:.6f}, "
            f"queued={len(self.mailbox)}, parked={self.parked_count})"
        )

    # --- mailbox --------------------------------------------------------------------------

    def offer(self, request: QueuedPull, now: float) -> bool:
        """Queue a new request; False (and counted as rejected) when the mailbox is full."""
        if self.pending >= self.capacity:
            self.rejected += 1
            if self.series is not None:
                self.series.rejected.inc()
            return False
        request.status = PullStatus.QUEUED
        request.queued_at = now
        self.mailbox.append(request)
        self.pending += 1
        self.totals.pending += 1
        return True

    def take(self) -> QueuedPull | None:
        """The next live request of the mailbox, marked running."""
        while self.mailbox:
            request = self.mailbox.popleft()
            if request.done:
                self.retire(request)
                continue
            request.status = PullStatus.RUNNING
            return request
        return None

    def retire(self, request: QueuedPull) -> None:
        """Forget an answered, failed or cancelled request (idempotent)."""
        if request.status is PullStatus.DONE:
            return
        was_parked = request.status is PullStatus.PARKED
        request.status = PullStatus.DONE
        self.pending -= 1
        self.totals.pending -= 1
        if was_parked:
            self._unpark_one()
            self._forget_answered()

    # --- parking and waking ---------------------------------------------------------------

    def park(self, request: QueuedPull) -> None:
        """Suspend a request that found nothing until data, its timeout or shutdown."""
        parked = self._parked.get(request.key)
        if parked is None:
            parked = self._parked[request.key] = deque()
        elif len(parked) > 64 and len(parked) > 4 * self.parked_count:
            parked = self._parked[request.key] = deque(
                r for r in parked if r.status is PullStatus.PARKED
            )
        while parked and parked[0].status is not PullStatus.PARKED:
            parked.popleft()
        if parked and request.arrived < parked[0].arrived:
            parked.appendleft(request)  # a resumed head that found nothing keeps its place
        else:
            parked.append(request)
        request.status = PullStatus.PARKED
        self.parked_count += 1
        self.totals.parked += 1
        heap = self._timeouts
        if len(heap) > 64 and len(heap) > 4 * self.parked_count:
            heap[:] = [entry for entry in heap if entry[2].status is PullStatus.PARKED]
            heapq.heapify(heap)
        heapq.heappush(heap, (request.wait_until, next(_ORDER), request))

    def has_parked(self, key: str) -> bool:
        parked = self._parked.get(key)
        return bool(parked) and self.parked_count > 0

    def promote(self, key: str) -> bool:
        """Move the oldest parked request of a key to the front of the mailbox."""
        parked = self._parked.get(key)
        found = False
        while parked and not found:
            request = parked.popleft()
            if request.status is PullStatus.PARKED:
                self._unpark_one()
                request.status = PullStatus.QUEUED
                self.mailbox.appendleft(request)
                found = True
        if parked is not None and not parked:
            self._parked.pop(key, None)  # one key per broadcast consumer: don't keep them all
        self._forget_answered()
        return found

    def wake_data(self, now: float) -> int:
        """New data may be there: retry the oldest parked request of every key."""
        self.wake_at = None
        self.empty_keys.clear()
        moved = 0
        for key in list(self._parked):
            if self.promote(key):
                moved += 1
                self.mailbox[0].queued_at = now
        return moved

    def wake_timeouts(self, now: float) -> int:
        """Parked requests whose wait ended go back to the mailbox, to be answered now."""
        moved = 0
        heap = self._timeouts
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            moved += self._requeue_parked(request, now)
        self._forget_answered()
        return moved

    def flush(self, now: float) -> int:
        """Shutdown: every parked request goes back to the mailbox to be answered now."""
        moved = 0
        for parked in self._parked.values():
            for request in reversed(parked):
                moved += self._requeue_parked(request, now)
            parked.clear()
        self._forget_answered()
        return moved

    def _requeue_parked(self, request: QueuedPull, now: float) -> int:
        """A still parked request to the front of the mailbox, its wait over; 1 if moved."""
        if request.status is not PullStatus.PARKED:
            return 0
        self._unpark_one()
        request.status = PullStatus.QUEUED
        request.timed_out = True
        request.queued_at = now
        self.mailbox.appendleft(request)
        return 1

    def _unpark_one(self) -> None:
        self.parked_count -= 1
        self.totals.parked -= 1

    def _forget_answered(self) -> None:
        """With nothing parked, the park queues hold only answered requests: drop them.

        They are otherwise dropped lazily at the next park; doing it when the last long
        poll leaves gives the memory of a burst back when the burst ends.
        """
        if not self.parked_count and (self._parked or self._timeouts):
            self._parked.clear()
            self._timeouts.clear()

    def next_timer_at(self) -> float | None:
        """When a parked request times out or the group has something due, if anything."""
        heap = self._timeouts
        while heap and heap[0][2].status is not PullStatus.PARKED:
            heapq.heappop(heap)
        if not heap:
            return None
        first = heap[0][0]
        return first if self.wake_at is None else min(first, self.wake_at)

    def live(self) -> Iterator[QueuedPull]:
        """Every request not answered yet that is queued or parked (not running)."""
        for request in self.mailbox:
            if not request.done:
                yield request
        for parked in self._parked.values():
            for request in parked:
                if request.status is PullStatus.PARKED:
                    yield request

    # --- accounting -----------------------------------------------------------------------

    def settle(self, now: float) -> None:
        """Track suspension: parked requests only, no worker on it and nothing queued."""
        suspended = self.parked_count > 0 and self.running == 0 and not self.mailbox
        if suspended and self.suspended_since is None:
            self.suspended_since = now
        elif not suspended and self.suspended_since is not None:
            spent = now - self.suspended_since
            self.suspended_since = None
            self.suspended_s += spent

    def note_cost(self, seconds_per_request: float) -> None:
        previous = self.cost_per_request
        self.cost_per_request = (
            seconds_per_request if previous is None else 0.7 * previous + 0.3 * seconds_per_request
        )

    def note_charge(self, seconds: float) -> None:
        previous = self.charge_per_request
        self.charge_per_request = seconds if previous is None else 0.7 * previous + 0.3 * seconds

    def batch_size(self, remaining_s: float, limit: float, cap: int) -> int:
        """How many requests to serve in one go to stay within ``remaining_s``, counting
        each request's work outside the run too (``charge_per_request``).

        One when the cost is not known yet; never more than ``limit`` or ``cap``.
        """
        size = float(cap)
        if self.cost_per_request is None:
            size = 1
        else:
            cost = self.cost_per_request + (self.charge_per_request or 0.0)
            if cost > 0:
                size = max(remaining_s / cost, 1)
        return int(min(size, limit, cap))

    def ran(self, elapsed: float, work: float) -> None:
        """A run ended: ``elapsed`` seconds of wall time, ``work`` of CPU (``Served``)."""
        self.runs += 1
        self.service_s += elapsed
        self.work_s += work
