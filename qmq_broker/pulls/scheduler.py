"""Which actor a free worker runs next, and for how long.

Threading model (why it is safe). Everything in this package runs on the broker's event
loop; a *worker* is an asyncio task that runs one actor at a time. Serving a request has
three steps: the decision (expire leases, choose seqs, append the LEASE record) runs on
the loop with no await in between, so group state and the journal are only ever touched
by the loop thread and a choice is recorded before anyone else can choose again; the
records are then read, on the loop when they are all in the page cache, else on a thread
of the read pool (one thread per worker), where a slow or cold read blocks only that
thread; the answer is set back on the loop. While a worker runs an actor in the fair
scheduler the actor is *running*, not in the run queue, so no other worker can serve it:
one group never holds more than one worker, which is what keeps a group crawling through
cold backlog from slowing the others: its reads' waits are isolated by that rule, not
charged. What a group is charged is the CPU its pulls cost, on the loop and on the read
thread (``Served``), not a run's wall time: that also holds the waits for a read thread
and for the GIL, which grow with everything else the broker does and are as long for a
lone one-message pull as for a batch of 64 requests.

``FairScheduler``: runnable actors in a priority queue by virtual runtime (accumulated
work, CFS-style), ties by submit time. A run lasts at most one time slice (the
check is after each request; a request is never split), then the actor yields and goes
back in the queue if it has more to do. An actor that becomes runnable from idle or
suspended starts no lower than the smallest virtual runtime of the runnable and running
actors, so a group that was quiet for an hour cannot then monopolise the workers (the
flaw QMQ hit when it ordered by total runtime).

Small pulls. Part of a pull's cost is not in the actor's run: reading the request,
decoding it, encoding and writing the answer. ``charge`` adds that part to the group's
virtual runtime: what the HTTP layer measures (decoding, encoding) and its estimate of the
loop's unmeasured work per request (parsing, routing, writing: most of a small pull's
cost). And a group with few consumers is empty between its answers and its consumers'
next pulls: with every pull small, a group of 100 consumers would get nearly every turn
while the 2 consumers of another are on their way back. So a group answered moments ago
stays *present* for ``anticipation_s`` (a consumer's round trip) plus the longest recent
run (its consumers' next pulls may wait for a run under way to end): while it is, an actor
ahead of it in virtual runtime waits (a worker idles briefly rather than run it), and a
present group that comes back keeps its virtual runtime instead of being lifted to the
floor. A group that does not come back within that time stops counting; a group whose
pulls wait for data (parked) is not present.

Most reads find their records in the page cache and are served on the loop, with no await
(``PullService``): a worker then yields to the loop after each run, so that answers are
written and new requests read before the next run is chosen.

``FifoScheduler``: the plain request queue the actor design replaces, kept for
benchmarks: one shared FIFO of requests, each served by whichever worker is free, so a
group's share follows its number of consumers and a slow group can hold every worker.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Iterable
from functools import partial
from typing import Any

from qmq_broker.clock import Clock, Timer
from qmq_broker.errors import RequestError
from qmq_broker.pulls.actor import PullActor, PullCounts
from qmq_broker.pulls.errors import DeadlineExceeded, MailboxFull, ShuttingDown, TooManyPulls
from qmq_broker.pulls.metrics import ActorMetrics, ActorReading
from qmq_broker.pulls.request import TIMER_SLACK_S, Processor, PullOutcome, PullStatus, QueuedPull

logger = logging.getLogger(__name__)

MAX_BATCH = 64  # requests served per read (on the loop or the read pool), at most
LONG_RUN_DECAY = 0.95  # per run: how fast the longest recent run is forgotten


class PullScheduler:
    """Mailboxes, long-poll suspension and the worker loop; subclasses pick what runs."""

    name = "base"

    def __init__(
        self,
        *,
        processor: Processor,
        clock: Clock,
        workers: int = 4,
        time_slice_s: float = 0.005,
        mailbox_size: int = 10_000,
        max_pending: int = 8_000,
        deadline_grace_s: float = 5.0,
        metrics: ActorMetrics | None = None,
    ) -> None:
        if workers < 1 or mailbox_size < 1 or max_pending < 1 or time_slice_s <= 0:
            raise ValueError("workers, mailbox_size, max_pending must be >= 1, time_slice_s > 0")
        self.workers = workers
        self.time_slice_s = time_slice_s
        self.mailbox_size = mailbox_size
        self.max_pending = max_pending
        self.totals = PullCounts()  # every actor's pending and parked pulls, summed
        self.deadline_grace_s = deadline_grace_s
        self._processor = processor
        self._clock = clock
        self._metrics = metrics
        self._actors: dict[tuple[str, str], PullActor] = {}
        self._by_subject: dict[str, list[PullActor]] = {}
        self._idle: deque[asyncio.Future[None]] = deque()
        self._serving: set[QueuedPull] = set()
        self.stopping = False
        self.measured_s = 0.0  # work measured so far, all actors: in runs and charged
        if metrics is not None:
            metrics.watch(self._gauges)
            metrics.watch_totals(lambda: (self.totals.pending, self.totals.parked))

    # --- requests in ------------------------------------------------------------------------

    def submit(
        self,
        *,
        subject: str,
        group: str,
        key: str,
        consumer: str,
        max_messages: int,
        wait_s: float,
        min_messages: int = 1,
        linger_s: float = 0.0,
        max_keys: int = 1,
        records: bool = False,
    ) -> asyncio.Future[list[Any]]:
        """Queue a pull in its group's mailbox; the future resolves with the messages.

        ``min_messages``/``linger_s``: for up to ``linger_s`` (within ``wait_s``) it is not
        answered with fewer than ``min_messages`` messages. ``records``: the messages as
        stored (``qmq_wire.records``) instead of their JSON.

        Raises ``MailboxFull`` (429) at once when the group has ``mailbox_size`` pending,
        ``TooManyPulls`` (429) when all groups together have ``max_pending``. Parked long
        polls count in both: each holds a connection and memory until it is answered.
        """
        if self.stopping:
            raise ShuttingDown()
        if self.totals.pending >= self.max_pending:
            if self._metrics is not None:
                self._metrics.pulls_refused.inc()
            raise TooManyPulls(limit=self.max_pending)
        now = self._clock.now()
        actor = self.actor(subject, group)
        request = QueuedPull(
            subject=subject,
            group=group,
            key=key,
            consumer=consumer,
            max_messages=max_messages,
            max_keys=max_keys,
            min_messages=min_messages,
            linger_until=now + min(linger_s, wait_s),
            records=records,
            arrived=now,
            wait_until=now + wait_s,
            deadline=now + wait_s + self.deadline_grace_s,
            future=asyncio.get_running_loop().create_future(),
        )
        if not actor.offer(request, now):
            raise MailboxFull(subject=subject, group=group, size=actor.capacity)
        request.future.add_done_callback(partial(self._on_future_done, actor, request))
        actor.settle(now)
        self._ready(actor, 1)
        return request.future

    def actor(self, subject: str, group: str) -> PullActor:
        actor = self._actors.get((subject, group))
        if actor is None:
            series = self._metrics.series(subject, group) if self._metrics else None
            actor = PullActor(
                subject, group, capacity=self.mailbox_size, series=series, totals=self.totals
            )
            self._actors[(subject, group)] = actor
            self._by_subject.setdefault(subject, []).append(actor)
            self._created(actor)
        return actor

    def wake_subject(self, subject: str) -> None:
        """New data on a subject (a produce, a nack, a redrive): resume its parked pulls."""
        now = self._clock.now()
        for actor in self._by_subject.get(subject, ()):
            if actor.parked_count:
                self._woken(actor, actor.wake_data(now), now)

    def _on_future_done(self, actor: PullActor, request: QueuedPull, _: object) -> None:
        if request.status is not PullStatus.DONE and request.status is not PullStatus.RUNNING:
            actor.retire(request)  # cancelled by the caller while queued or parked
            actor.settle(self._clock.now())
            self._arm(actor)

    # --- timers ---------------------------------------------------------------------------

    def _arm(self, actor: PullActor) -> None:
        when = actor.next_timer_at()
        if when == actor.timer_at:
            return
        if actor.timer is not None:
            actor.timer.cancel()
        actor.timer = None
        actor.timer_at = when
        if when is not None:
            actor.timer = self._clock.call_at(when, partial(self._on_timer, actor))

    def _on_timer(self, actor: PullActor) -> None:
        actor.timer = None
        actor.timer_at = None
        now = self._clock.now()
        moved = actor.wake_timeouts(now + TIMER_SLACK_S)
        if actor.wake_at is not None and actor.wake_at <= now + TIMER_SLACK_S:
            moved += actor.wake_data(now)
        self._woken(actor, moved, now)

    def _woken(self, actor: PullActor, moved: int, now: float) -> None:
        if moved:
            actor.settle(now)
            self._ready(actor, moved)
        self._arm(actor)

    # --- workers --------------------------------------------------------------------------

    async def run_worker(self) -> None:
        """One worker: run whatever the policy picks, sleep when nothing is runnable."""
        loop = asyncio.get_running_loop()
        while True:
            picked = self.next_run()
            if picked is None:
                waiter: asyncio.Future[None] = loop.create_future()
                self._idle.append(waiter)
                await waiter
                continue
            await self.run(*picked)
            # A run whose records were all in the page cache never waited: let the loop
            # write its answers and read new requests before the next run is chosen. With
            # nothing queued, the wait for work above yields anyway.
            if self.queued():
                await asyncio.sleep(0)

    def _kick(self, count: int = 1) -> None:
        while count > 0 and self._idle:
            waiter = self._idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                count -= 1

    async def run(self, actor: PullActor, budget_s: float, limit: float) -> None:
        """Serve an actor's requests until its mailbox empties, ``limit`` or the budget.

        Requests are served in batches sized from the actor's recent cost per request, so
        that one hand-off to the read pool serves as many requests as fit in what is left
        of the slice (one at first, and one at a time for a slow group). The budget counts
        each request's recent work outside the run as well (``charge``): answering a
        slice's requests then also takes about a slice, so a group whose consumers wait
        for those answers to be written is not kept away for much longer.
        """
        clock = self._clock
        start = clock.now()
        actor.running += 1
        actor.settle(start)
        actor.empty_keys.clear()
        taken = 0
        work = 0.0
        outside = actor.charge_per_request or 0.0  # each answer's work after the run
        try:
            while taken < limit:
                elapsed = clock.now() - start + taken * outside
                if taken and elapsed >= budget_s:
                    break
                want = actor.batch_size(budget_s - elapsed, limit - taken, MAX_BATCH)
                count, batch = self._admit(actor, want)
                if not count:
                    break
                taken += count
                if batch:
                    began = clock.now()
                    work += await self._serve(actor, batch)
                    actor.note_cost((clock.now() - began) / len(batch))
        finally:
            end = clock.now()
            actor.running -= 1
            if taken:
                actor.ran(end - start, work)
            self.measured_s += work
            self._finished(actor, work, end - start)
            actor.settle(end)
            self._arm(actor)

    def _admit(self, actor: PullActor, want: int) -> tuple[int, list[QueuedPull]]:
        """Take up to ``want`` requests to serve; expired ones are answered 503 on the way.

        Returns how many requests left the mailbox and those that need serving.
        """
        now = self._clock.now()
        taken = 0
        batch: list[QueuedPull] = []
        while len(batch) < want:
            request = actor.take()
            if request is None:
                break
            taken += 1
            if actor.series is not None:
                actor.series.queue_wait.observe(now - request.queued_at)
            if now > request.deadline:
                actor.expired += 1
                if actor.series is not None:
                    actor.series.expired.inc()
                waited = now - request.arrived
                error = DeadlineExceeded(subject=actor.subject, group=actor.group, waited_s=waited)
                self._fail(actor, request, error)
            elif (
                request.key in actor.empty_keys
                and not request.timed_out
                and not self.stopping
                and now < request.wait_until
            ):
                actor.park(request)  # same state found nothing moments ago in this run
            else:
                batch.append(request)
        return taken, batch

    async def _serve(self, actor: PullActor, batch: list[QueuedPull]) -> float:
        """Serve a batch; the work it cost (``Served.work_s``; 0 when it failed)."""
        self._serving.update(batch)
        try:
            served = await self._processor(batch)
        except asyncio.CancelledError:
            for request in batch:  # the worker is being stopped: answer, don't strand
                self._fail(actor, request, ShuttingDown())
            raise
        except Exception as exc:
            if not isinstance(exc, RequestError):
                logger.exception(
                    "pull failed",
                    extra={
                        "action": "broker.pull_failed",
                        "subject": actor.subject,
                        "group": actor.group,
                    },
                )
            for request in batch:
                self._fail(actor, request, exc)
            return 0.0
        finally:
            self._serving.difference_update(batch)
        for request, outcome in zip(batch, served.outcomes, strict=True):
            self._conclude(actor, request, outcome)
        return served.work_s

    def _conclude(self, actor: PullActor, request: QueuedPull, outcome: PullOutcome) -> None:
        if outcome.messages is not None:
            self._answer(actor, request, outcome.messages)
            if actor.has_parked(request.key) and actor.promote(request.key):
                self._ready(actor, 1)  # data flowed: let the next waiter of this key look
            return
        if not outcome.lingering:  # a lingering one saw messages: others of its key may not
            actor.empty_keys.add(request.key)
        if outcome.wake_at is not None:
            actor.wake_at = (
                outcome.wake_at if actor.wake_at is None else min(actor.wake_at, outcome.wake_at)
            )
        if (
            request.timed_out
            or self.stopping
            or request.done
            or self._clock.now() >= request.wait_until
        ):
            self._answer(actor, request, [])
        else:
            actor.park(request)

    @staticmethod
    def _answer(actor: PullActor, request: QueuedPull, messages: list[Any]) -> None:
        if not request.future.done():
            request.future.set_result(messages)
        actor.retire(request)

    @staticmethod
    def _fail(actor: PullActor, request: QueuedPull, exc: BaseException) -> None:
        if not request.future.done():
            request.future.set_exception(exc)
        actor.retire(request)

    # --- shutdown -------------------------------------------------------------------------

    def drain(self) -> None:
        """Stop taking pulls and answer every parked long poll now (SIGTERM)."""
        self.stopping = True
        now = self._clock.now()
        for actor in self._actors.values():
            self._woken(actor, actor.flush(now), now)

    def close(self) -> None:
        """Fail whatever is still pending with 503 (the workers are stopped by then)."""
        self.stopping = True
        for actor in self._actors.values():
            if actor.timer is not None:
                actor.timer.cancel()
                actor.timer = None
            for request in list(actor.live()):
                self._fail(actor, request, ShuttingDown())
            actor.mailbox.clear()
        for request in list(self._serving):
            self._fail(self._actors[(request.subject, request.group)], request, ShuttingDown())
        self._serving.clear()
        for waiter in self._idle:
            if not waiter.done():
                waiter.cancel()
        self._idle.clear()

    # --- policy hooks ---------------------------------------------------------------------

    def _created(self, actor: PullActor) -> None:
        """A new actor appeared."""

    def _ready(self, actor: PullActor, added: int) -> None:
        """``added`` requests were put in the actor's mailbox."""
        raise NotImplementedError

    def next_run(self) -> tuple[PullActor, float, float] | None:
        """The actor to run now with its time budget and request limit, if any."""
        raise NotImplementedError

    def queued(self) -> bool:
        """Whether an actor waits to run."""
        raise NotImplementedError

    def _finished(self, actor: PullActor, work: float, elapsed: float) -> None:
        """A run ended after ``elapsed`` seconds; its requests cost ``work`` (``Served``)."""

    def charge(self, subject: str, group: str, measured: float, estimated: float = 0.0) -> None:
        """Work done for a group's pull outside its actor's run counts toward the group's
        share: ``measured`` (decoding the request, encoding the answer) and ``estimated``
        (its part of the loop's unmeasured work: parsing, routing, writing)."""
        self.measured_s += measured
        actor = self._actors.get((subject, group))
        if actor is not None:
            seconds = measured + estimated
            actor.charged_s += seconds
            actor.note_charge(seconds)
            self._charged(actor, seconds)

    def _charged(self, actor: PullActor, seconds: float) -> None:
        """``seconds`` of work outside its runs were done for ``actor``."""

    def _gauges(self) -> Iterable[ActorReading]:
        for actor in list(self._actors.values()):
            yield ActorReading(
                subject=actor.subject,
                group=actor.group,
                queued=len(actor.mailbox),
                parked=actor.parked_count,
                vruntime=actor.vruntime,
                runs=actor.runs,
                service_s=actor.service_s,
                work_s=actor.work_s,
                suspended_s=actor.suspended_s,
            )


class FairScheduler(PullScheduler):
    """Lowest virtual runtime first, one time slice per run, one worker per actor."""

    name = "fair"

    def __init__(self, *, anticipation_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if anticipation_s < 0:
            raise ValueError("anticipation_s must be >= 0")
        self.anticipation_s = anticipation_s
        self._queue: list[tuple[float, float, int, PullActor]] = []
        self._order = itertools.count()
        self._running: set[PullActor] = set()
        self._present: set[PullActor] = set()  # idle, answered within anticipation_s
        self._hold_timer: Timer | None = None
        self._hold_until: float | None = None
        self._floor = 0.0  # min virtual runtime seen; never goes down
        self._long_run = 0.0  # recent longest run (wall seconds), decaying

    def min_vruntime(self) -> float:
        """The smallest virtual runtime among runnable, running and present actors
        (monotonic)."""
        candidates = [actor.vruntime for actor in self._running]
        candidates.extend(actor.vruntime for actor in self._present)
        if self._queue:
            candidates.append(self._queue[0][0])
        if candidates:
            self._floor = max(self._floor, min(candidates))
        return self._floor

    def _created(self, actor: PullActor) -> None:
        actor.vruntime = self.min_vruntime()

    def _ready(self, actor: PullActor, added: int) -> None:
        if actor.runnable or actor.running or not actor.mailbox:
            return  # queued already, or re-queued by _finished when its run ends
        if actor in self._present:
            self._present.discard(actor)  # back in time: it keeps its place
        else:
            actor.vruntime = max(actor.vruntime, self.min_vruntime())
        self._push(actor)

    def _push(self, actor: PullActor) -> None:
        actor.runnable = True
        actor.submitted_at = self._clock.now()
        heapq.heappush(self._queue, (actor.vruntime, actor.submitted_at, next(self._order), actor))
        self._kick()

    def queued(self) -> bool:
        return bool(self._queue)

    def next_run(self) -> tuple[PullActor, float, float] | None:
        if not self._queue:
            return None
        if self._present and self._held(self._queue[0][0]):
            return None
        actor = heapq.heappop(self._queue)[3]
        actor.runnable = False
        self._running.add(actor)
        return actor, self.time_slice_s, math.inf

    def _held(self, vruntime: float) -> bool:
        """Whether the next actor waits for a present one it is ahead of; arms the timer
        that ends the wait when the presence does."""
        now = self._clock.now()
        gone = [actor for actor in self._present if actor.present_until <= now]
        self._present.difference_update(gone)
        ahead_of = [a for a in self._present if vruntime > a.vruntime]
        if not ahead_of:
            return False
        until = min(actor.present_until for actor in ahead_of)
        if self._hold_until is None or until < self._hold_until:
            if self._hold_timer is not None:
                self._hold_timer.cancel()
            self._hold_until = until
            self._hold_timer = self._clock.call_at(until, self._hold_ended)
        return True

    def _hold_ended(self) -> None:
        self._hold_timer = None
        self._hold_until = None
        self._kick(self.workers)

    def _finished(self, actor: PullActor, work: float, elapsed: float) -> None:
        actor.vruntime += work
        self._long_run = max(elapsed, self._long_run * LONG_RUN_DECAY)
        self.min_vruntime()  # the floor follows the actors that run, even a lone one
        self._running.discard(actor)
        if actor.mailbox:
            self._push(actor)
        elif self.anticipation_s > 0 and not actor.parked_count:
            # its consumers' next pulls may wait for a run that is under way to end
            actor.present_until = self._clock.now() + self.anticipation_s + self._long_run
            self._present.add(actor)

    def _charged(self, actor: PullActor, seconds: float) -> None:
        # A runnable actor's queue entry keeps the key it was pushed with; the charge
        # orders it from its next push on (re-keying the heap per request would cost more).
        actor.vruntime += seconds

    def runnable(self) -> list[PullActor]:
        """Runnable actors in the order they would run (for tests and debugging)."""
        return [entry[3] for entry in sorted(self._queue)]


class FifoScheduler(PullScheduler):
    """One shared FIFO of requests; any free worker takes the next one."""

    name = "fifo"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tickets: deque[PullActor] = deque()  # one per queued request, in arrival order

    def _ready(self, actor: PullActor, added: int) -> None:
        self._tickets.extend(itertools.repeat(actor, added))
        self._kick(added)

    def queued(self) -> bool:
        return bool(self._tickets)

    def next_run(self) -> tuple[PullActor, float, float] | None:
        if not self._tickets:
            return None
        return self._tickets.popleft(), math.inf, 1


SCHEDULERS: dict[str, type[PullScheduler]] = {"fair": FairScheduler, "fifo": FifoScheduler}
