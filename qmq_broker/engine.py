"""The broker: recovers one data directory, builds its services on the recovered state
(``qmq_broker.services``) and runs their lifecycle.

Start recovers on a worker thread (the lifecycle answers ``recovering`` meanwhile), then
builds the services and spawns their supervised loops. Everything runs on one asyncio loop;
state changes happen between awaits, so each operation sees and leaves a consistent state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from qmq_broker.clock import Clock, SystemClock
from qmq_broker.config import BrokerConfig
from qmq_broker.console.recent_consumers import RecentConsumers
from qmq_broker.delayed.metrics import ScheduleMetrics
from qmq_broker.delayed.recovery import recover_schedule
from qmq_broker.errors import QmqBrokerError, Unavailable
from qmq_broker.format.files import SegmentKind
from qmq_broker.lifecycle import Lifecycle
from qmq_broker.memory import malloc_trim
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.ordered.opening import open_routes
from qmq_broker.pulls import ActorMetrics
from qmq_broker.recovery.recover import Recovered, recover
from qmq_broker.routebook import RouteBook
from qmq_broker.services import Services, Shared, build_services
from qmq_broker.storage.segments import SegmentReader

logger = logging.getLogger(__name__)


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
        self.shared = Shared(
            config=config,
            clock=self.clock,
            metrics=metrics,
            lifecycle=self.lifecycle,
            reader=self._reader,
            recent_consumers=RecentConsumers(now=self.clock.now),
            actor_metrics=ActorMetrics(metrics.registry),
            schedule_metrics=ScheduleMetrics(metrics.registry),
        )
        """What the services and the HTTP layer are built with."""
        self.recent_consumers = self.shared.recent_consumers
        """Consumers heard from lately, noted by the HTTP layer on pulls, acks and nacks."""
        self._services: Services | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # --- the services ------------------------------------------------------------------------

    @property
    def status(self) -> str:
        return self.lifecycle.status.value

    @property
    def services(self) -> Services:
        """The services; ``recovering`` until ``start()`` has built them."""
        if self._services is None:
            raise Unavailable(code="recovering", message="the broker is still recovering")
        return self._services

    def measured_pull_work_s(self) -> float:
        """CPU seconds of pull work measured so far; 0 before the broker is ready."""
        return 0.0 if self._services is None else self._services.delivery.measured_s()

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
        book = RouteBook(routes.routes, fenced=routes.fenced)
        services = self._services = build_services(self.shared, recovered, scheduled, book)
        for name, loop in services.loops(self.config.workers):
            self._spawn(loop, name)
        commands = await services.routes.restore_commands()
        self.lifecycle.open(services.journal)
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
        if self._services is not None:
            self._services.pulls.drain()

    async def close(self) -> None:
        """Checkpoint and close the journal (after in-flight requests finished)."""
        self.begin_shutdown()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        services = self._services
        if services is not None:
            services.pulls.close()
            services.read_pool.shutdown(wait=False, cancel_futures=True)
            if services.journal.failed is None:
                await services.maintenance.checkpoint()
            await services.journal.close()
            services.delayed.close()
        self._reader.close()
        if self.recovered is not None:
            await asyncio.to_thread(self.recovered.subjects.close)
        logger.info("broker stopped", extra={"action": "broker.stopped"})
