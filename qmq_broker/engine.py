"""The broker: wires its services over one data directory and runs their lifecycle.

Start recovers on a worker thread (the gate answers ``recovering`` meanwhile), then builds
the services on the recovered state and spawns their supervised loops. Everything runs on
one asyncio loop; state changes happen between awaits, so each operation sees and leaves a
consistent state, and disk writes go through the journal's group commit.

Who owns what: ``SubjectTable`` (seqs, bytes, dedup) and ``GroupTable`` (delivery state)
are the only writers of their state; ``ProduceService`` stores messages, ``DeliveryService``
serves groups, ``DelayedMessages`` holds messages until due, ``Maintenance`` checkpoints and
applies retention, ``StatsService`` answers operators, ``Lifecycle`` says who may come in;
``RouteBook`` holds ordered subjects' routes (``RouteService`` changes them,
``OrderedPulls`` serves their groups); ``ConsoleService`` answers the console's pages from a
sampled history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from qmq_broker.actions import ActionLog
from qmq_broker.clock import Clock, SystemClock
from qmq_broker.config import BrokerConfig
from qmq_broker.console.history import History
from qmq_broker.console.recent_consumers import RecentConsumers
from qmq_broker.console.sampler import ConsoleSampler
from qmq_broker.console.service import ConsoleService
from qmq_broker.delayed.metrics import ScheduleMetrics
from qmq_broker.delayed.recovery import ScheduleRecovered, recover_schedule
from qmq_broker.delayed.service import DelayedMessages
from qmq_broker.delivery import DeliveryService
from qmq_broker.errors import QmqBrokerError, Unavailable
from qmq_broker.format.files import SegmentKind
from qmq_broker.groups import Policy
from qmq_broker.lifecycle import Lifecycle
from qmq_broker.maintenance import Maintenance
from qmq_broker.memory import malloc_trim
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.ordered.opening import open_routes
from qmq_broker.ordered.service import RouteService
from qmq_broker.produce import ProduceService
from qmq_broker.pulls import SCHEDULERS, ActorMetrics, PullScheduler
from qmq_broker.pulls.ordered import OrderedPulls
from qmq_broker.pulls.service import PullService
from qmq_broker.recovery.recover import Recovered, recover
from qmq_broker.routebook import RouteBook
from qmq_broker.stats import StatsService
from qmq_broker.storage.journal import Journal
from qmq_broker.storage.segments import SegmentReader
from qmq_wire.ordered import split_partition_log

logger = logging.getLogger(__name__)
S = TypeVar("S")
CONSOLE_SAMPLES = 360  # the console's charts: an hour at the default 10 s interval
CONSOLE_MAX_SERIES = 2_000  # rates in, rates out and backlogs tracked (2.9 KB each)


class Broker:
    """One broker over one data directory.

    The services exist once ``start()`` has recovered; before that (and after a failed
    recovery) reaching for one answers ``recovering``.
    """

    def __init__(
        self, config: BrokerConfig, *, metrics: BrokerMetrics, clock: Clock | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock if clock is not None else SystemClock()
        self.lifecycle = Lifecycle()
        self.recovered: Recovered | None = None
        self._reader = SegmentReader(config.data_dir, SegmentKind.MESSAGES)
        self._read_pool: ThreadPoolExecutor | None = None
        self._actor_metrics = ActorMetrics(metrics.registry)
        self._schedule_metrics = ScheduleMetrics(metrics.registry)
        self._tasks: list[asyncio.Task[None]] = []
        self._journal: Journal | None = None
        self._pulls: PullScheduler | None = None
        self._producer: ProduceService | None = None
        self._delivery: DeliveryService | None = None
        self._delayed: DelayedMessages | None = None
        self._maintenance: Maintenance | None = None
        self._stats: StatsService | None = None
        self._routes: RouteService | None = None
        self._console: ConsoleService | None = None
        self.recent_consumers = RecentConsumers(now=self.clock.now)
        """Consumers heard from lately, noted by the HTTP layer on pulls, acks and nacks."""

    # --- the services ------------------------------------------------------------------------

    @property
    def status(self) -> str:
        return self.lifecycle.status.value

    @property
    def producer(self) -> ProduceService:
        return _ready(self._producer)

    @property
    def delivery(self) -> DeliveryService:
        return _ready(self._delivery)

    def measured_pull_work_s(self) -> float:
        """CPU seconds of pull work measured so far (``DeliveryService.measured_s``); 0
        before the broker is ready."""
        return 0.0 if self._delivery is None else self._delivery.measured_s()

    @property
    def delayed(self) -> DelayedMessages:
        return _ready(self._delayed)

    @property
    def maintenance(self) -> Maintenance:
        return _ready(self._maintenance)

    @property
    def stats(self) -> StatsService:
        return _ready(self._stats)

    @property
    def routes(self) -> RouteService:
        return _ready(self._routes)

    @property
    def console(self) -> ConsoleService:
        return _ready(self._console)

    @property
    def journal(self) -> Journal:
        return _ready(self._journal)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Recover on a worker thread, then build the services and start their loops."""
        try:
            recovered = await asyncio.to_thread(
                recover,
                self.config.data_dir,
                dedup_window_s=self.config.dedup_window_s,
                now_us=self.clock.wall_us(),
                on_damage=self.config.on_damage,
            )
            scheduled = await asyncio.to_thread(
                recover_schedule, self.config.data_dir, on_damage=self.config.on_damage
            )
            routes = await asyncio.to_thread(
                open_routes,
                self.config.data_dir,
                subjects=recovered.subjects,
                reader=self._reader,
                on_damage=self.config.on_damage,
            )
        except QmqBrokerError:
            self.lifecycle.fail()
            logger.critical(
                "recovery failed", extra={"action": "broker.recovery_failed"}, exc_info=True
            )
            raise
        for store in recovered.subjects.dedup_stores():
            store.release_pages()  # what opening the stores read
        trim = malloc_trim()
        if trim is not None:
            await asyncio.to_thread(trim)  # recovery's temporaries
        self.recovered = recovered
        problems = recovered.problems + scheduled.problems + routes.problems
        self.metrics.recovery_problems.set(len(problems))
        self._wire(recovered, scheduled, RouteBook(routes.routes, fenced=routes.fenced))
        commands = await self.routes.restore_commands()
        self.lifecycle.open(self.journal)
        logger.info(
            "broker recovered",
            extra={
                "action": "broker.recovered",
                "seconds": round(recovered.seconds, 3),
                "subjects": len(recovered.subjects),
                "messages": recovered.subjects.messages(),
                "groups": len(recovered.groups),
                "scheduled": len(scheduled.ids),
                "ordered": len(routes.routes),
                "fenced": sorted(routes.fenced),
                "commands_appended": commands,
                "problems": problems,
            },
        )

    def _wire(self, recovered: Recovered, scheduled: ScheduleRecovered, book: RouteBook) -> None:
        config, clock, metrics = self.config, self.clock, self.metrics
        subjects, groups = recovered.subjects, recovered.groups
        journal = self._journal = Journal(
            data_dir=config.data_dir,
            fsync=config.fsync,
            segment_bytes=config.segment_bytes,
            messages_at=recovered.messages_at,
            actions_at=recovered.actions_at,
            buckets_at=scheduled.ends,
            on_fsync=metrics.fsync_seconds.observe,
            ack_fsync=config.ack_fsync,
        )
        journal.start()
        actions = ActionLog(journal=journal, groups=groups)
        policy = Policy(
            ack_timeout_us=int(config.ack_timeout_s * 1_000_000),
            max_attempts=config.max_attempts,
            backoff_s=config.backoff_s,
        )
        self._read_pool = ThreadPoolExecutor(config.workers, thread_name_prefix="qmq-pull-read")
        ordered = OrderedPulls(
            book=book,
            subjects=subjects,
            groups=groups,
            actions=actions,
            policy=policy,
            clock=clock,
            lease_s=config.partition_lease_s,
        )
        fair_only = {"anticipation_s": config.anticipation_s} if config.scheduler == "fair" else {}
        pulls = self._pulls = SCHEDULERS[config.scheduler](
            processor=PullService(
                groups=groups,
                subjects=subjects,
                actions=actions,
                reader=self._reader,
                policy=policy,
                clock=clock,
                executor=self._read_pool,
                metrics=metrics,
                read_delays={(s, g): d for s, g, d in config.debug_read_delay_s},
                ordered=ordered,
                readahead_wait_s=config.readahead_wait_s,
            ),
            clock=clock,
            workers=config.workers,
            time_slice_s=config.time_slice_s,
            **fair_only,
            mailbox_size=config.mailbox_size,
            max_pending=config.max_pending_pulls,
            deadline_grace_s=config.pull_grace_s,
            metrics=self._actor_metrics,
        )
        producer = self._producer = ProduceService(
            lifecycle=self.lifecycle,
            journal=journal,
            subjects=subjects,
            reader=self._reader,
            clock=clock,
            metrics=metrics,
            wake=lambda log: pulls.wake_subject(split_partition_log(log)[0]),
            book=book,
        )
        delayed = self._delayed = DelayedMessages(
            data_dir=config.data_dir,
            journal=journal,
            recovered=scheduled,
            store_due=producer.store_due,
            metrics=self._schedule_metrics,
            clock=clock,
            tick_us=int(config.schedule_tick_s * 1_000_000),
            load_ahead_us=int(config.schedule_load_ahead_s * 1_000_000),
        )
        producer.attach(delayed)
        self._schedule_metrics.watch(delayed.snapshot)
        self._delivery = DeliveryService(
            lifecycle=self.lifecycle,
            journal=journal,
            subjects=subjects,
            groups=groups,
            actions=actions,
            pulls=pulls,
            reader=self._reader,
            policy=policy,
            clock=clock,
            metrics=metrics,
            wake=pulls.wake_subject,
            ordered=ordered,
        )
        self._routes = RouteService(
            data_dir=config.data_dir,
            lifecycle=self.lifecycle,
            book=book,
            subjects=subjects,
            store_commands=producer.store_commands,
            ordered=ordered,
            reader=self._reader,
            clock=clock,
            wake=pulls.wake_subject,
            known_elsewhere=delayed.knows,
        )
        maintenance = self._maintenance = Maintenance(
            data_dir=config.data_dir,
            journal=journal,
            subjects=subjects,
            groups=groups,
            reader=self._reader,
            clock=clock,
            metrics=metrics,
            retention_s=config.retention_s,
            dedup_window_s=config.dedup_window_s,
            checkpoint_interval_s=config.checkpoint_interval_s,
            retention_check_interval_s=config.retention_check_interval_s,
        )
        self._stats = StatsService(
            lifecycle=self.lifecycle, subjects=subjects, groups=groups, delayed=delayed, book=book
        )
        metrics.watch_groups(self._stats.group_backlogs)
        console = self._console = ConsoleService(
            lifecycle=self.lifecycle,
            stats=self._stats,
            sampler=ConsoleSampler(
                stats=self._stats,
                fsync_seconds=metrics.fsync_seconds,
                data_dir=config.data_dir,
                clock=clock,
                history=History(capacity=CONSOLE_SAMPLES, max_series=CONSOLE_MAX_SERIES),
                interval_s=config.console_sample_interval_s,
            ),
            recent_consumers=self.recent_consumers,
            ordered=ordered,
            clock=clock,
        )
        self._spawn(delayed.run, "qmq-schedule-wheel")
        for index in range(config.workers):
            self._spawn(pulls.run_worker, f"qmq-pull-worker-{index}")
        self._spawn(maintenance.checkpoint_loop, "qmq-checkpointer")
        self._spawn(maintenance.retention_loop, "qmq-retention")
        self._spawn(maintenance.dedup_loop, "qmq-dedup")
        self._spawn(console.sample_loop, "qmq-console-sampler")
        metrics.watch_storage(subjects)

    def _spawn(self, loop: Callable[[], Awaitable[None]], name: str) -> None:
        async def supervised() -> None:
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.critical(f"{name} died", extra={"action": "broker.loop_died"}, exc_info=True)
                self.lifecycle.fail()
                raise

        self._tasks.append(asyncio.create_task(supervised(), name=name))

    def begin_shutdown(self) -> None:
        """Stop taking requests and wake every long poll so it answers now."""
        self.lifecycle.begin_stop()
        if self._pulls is not None:
            self._pulls.drain()

    async def close(self) -> None:
        """Checkpoint and close the journal (after in-flight requests finished)."""
        self.begin_shutdown()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._pulls is not None:
            self._pulls.close()
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=False, cancel_futures=True)
        if self._journal is not None:
            if self._journal.failed is None and self._maintenance is not None:
                await self._maintenance.checkpoint()
            await self._journal.close()
        if self._delayed is not None:
            self._delayed.close()
        self._reader.close()
        if self.recovered is not None:
            await asyncio.to_thread(self.recovered.subjects.close)
        logger.info("broker stopped", extra={"action": "broker.stopped"})


def _ready(service: S | None) -> S:
    if service is None:
        raise Unavailable(code="recovering", message="the broker is still recovering")
    return service
