"""The broker's services, built over recovered state: one step per service, in the order
they depend on each other. ``qmq_broker.engine`` runs their lifecycle."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from qmq_broker.actions import ActionLog
from qmq_broker.clock import Clock
from qmq_broker.config import BrokerConfig
from qmq_broker.console.history import History
from qmq_broker.console.recent_consumers import RecentConsumers
from qmq_broker.console.sampler import ConsoleSampler
from qmq_broker.console.service import ConsoleService
from qmq_broker.delayed.metrics import ScheduleMetrics
from qmq_broker.delayed.recovery import ScheduleRecovered
from qmq_broker.delayed.service import DelayedMessages
from qmq_broker.delivery import DeliveryService
from qmq_broker.groups import GroupTable
from qmq_broker.lifecycle import Lifecycle
from qmq_broker.maintenance import Maintenance
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.ordered.service import RouteService
from qmq_broker.produce import ProduceService
from qmq_broker.pulls import SCHEDULERS, ActorMetrics, PullScheduler
from qmq_broker.pulls.ordered import OrderedPulls
from qmq_broker.pulls.service import PullService
from qmq_broker.recovery.recover import Recovered
from qmq_broker.resets import ResetService
from qmq_broker.routebook import RouteBook
from qmq_broker.stats import StatsService
from qmq_broker.storage.journal import Journal
from qmq_broker.storage.segments import SegmentReader
from qmq_broker.subjects import SubjectTable
from qmq_wire.delivery import RetryPolicy
from qmq_wire.ordered import split_partition_log

CONSOLE_SAMPLES = 360  # the console's charts: an hour at the default 10 s interval
CONSOLE_MAX_SERIES = 2_000  # rates in, rates out and backlogs tracked

Loop = tuple[str, Callable[[], Awaitable[None]]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shared:
    """What every service and the HTTP layer are built with: settings, time, metrics, the
    lifecycle, the reader, the consumers heard from lately."""

    config: BrokerConfig
    clock: Clock
    metrics: BrokerMetrics
    lifecycle: Lifecycle
    reader: SegmentReader
    recent_consumers: RecentConsumers
    actor_metrics: ActorMetrics
    schedule_metrics: ScheduleMetrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class Services:
    """The broker's services once it has recovered; the HTTP layer calls these."""

    journal: Journal
    read_pool: ThreadPoolExecutor
    pulls: PullScheduler
    producer: ProduceService
    delivery: DeliveryService
    resets: ResetService
    delayed: DelayedMessages
    maintenance: Maintenance
    stats: StatsService
    routes: RouteService
    console: ConsoleService

    def loops(self, workers: int) -> list[Loop]:
        """The supervised loops to run, each with its task name."""
        return [
            ("qmq-schedule-wheel", self.delayed.run),
            *((f"qmq-pull-worker-{i}", self.pulls.run_worker) for i in range(workers)),
            ("qmq-checkpointer", self.maintenance.checkpoint_loop),
            ("qmq-retention", self.maintenance.retention_loop),
            ("qmq-dedup", self.maintenance.dedup_loop),
            ("qmq-console-sampler", self.console.sample_loop),
        ]


def build_services(
    shared: Shared, recovered: Recovered, scheduled: ScheduleRecovered, book: RouteBook
) -> Services:
    """Build the services over recovered state and start the journal's writer."""
    config, subjects, groups = shared.config, recovered.subjects, recovered.groups
    journal = _journal(shared, recovered, scheduled)
    journal.start()
    actions = ActionLog(journal=journal, groups=groups)
    policy = RetryPolicy(
        ack_timeout_us=int(config.ack_timeout_s * 1_000_000),
        max_attempts=config.max_attempts,
        backoff_s=config.backoff_s,
    )
    ordered = OrderedPulls(
        book=book,
        subjects=subjects,
        groups=groups,
        actions=actions,
        policy=policy,
        clock=shared.clock,
        lease_s=config.partition_lease_s,
        reader=shared.reader,
    )
    read_pool = ThreadPoolExecutor(config.workers, thread_name_prefix="qmq-pull-read")
    pulls = _pull_scheduler(shared, recovered, actions, policy, ordered, read_pool)
    producer = ProduceService(
        lifecycle=shared.lifecycle,
        journal=journal,
        subjects=subjects,
        reader=shared.reader,
        clock=shared.clock,
        metrics=shared.metrics,
        wake=lambda log: pulls.wake_subject(split_partition_log(log)[0]),
        book=book,
    )
    delayed = _delayed(shared, journal, scheduled, producer)
    stats = StatsService(
        lifecycle=shared.lifecycle,
        subject_table=subjects,
        groups=groups,
        delayed=delayed,
        book=book,
    )
    shared.metrics.watch_groups(stats.group_backlogs)
    shared.metrics.watch_storage(subjects)
    return Services(
        journal=journal,
        read_pool=read_pool,
        pulls=pulls,
        producer=producer,
        delivery=DeliveryService(
            lifecycle=shared.lifecycle,
            journal=journal,
            subjects=subjects,
            groups=groups,
            actions=actions,
            pulls=pulls,
            reader=shared.reader,
            policy=policy,
            clock=shared.clock,
            metrics=shared.metrics,
            ordered=ordered,
        ),
        resets=ResetService(
            lifecycle=shared.lifecycle,
            journal=journal,
            subjects=subjects,
            groups=groups,
            actions=actions,
            ordered=ordered,
            clock=shared.clock,
            wake=pulls.wake_subject,
        ),
        delayed=delayed,
        maintenance=_maintenance(shared, journal, subjects, groups),
        stats=stats,
        routes=RouteService(
            data_dir=config.data_dir,
            lifecycle=shared.lifecycle,
            book=book,
            subjects=subjects,
            store_commands=producer.store_commands,
            ordered=ordered,
            reader=shared.reader,
            wake=pulls.wake_subject,
            known_elsewhere=delayed.knows,
        ),
        console=_console(shared, stats, ordered),
    )


def _journal(shared: Shared, recovered: Recovered, scheduled: ScheduleRecovered) -> Journal:
    config = shared.config
    return Journal(
        data_dir=config.data_dir,
        fsync=config.fsync,
        segment_bytes=config.segment_bytes,
        messages_at=recovered.messages_at,
        actions_at=recovered.actions_at,
        buckets_at=scheduled.ends,
        bucket_records=scheduled.records,
        on_fsync=shared.metrics.fsync_seconds.observe,
        ack_fsync=config.ack_fsync,
    )


def _pull_scheduler(
    shared: Shared,
    recovered: Recovered,
    actions: ActionLog,
    policy: RetryPolicy,
    ordered: OrderedPulls,
    read_pool: ThreadPoolExecutor,
) -> PullScheduler:
    config = shared.config
    fair_only = {"anticipation_s": config.anticipation_s} if config.scheduler == "fair" else {}
    return SCHEDULERS[config.scheduler](
        processor=PullService(
            groups=recovered.groups,
            subjects=recovered.subjects,
            actions=actions,
            reader=shared.reader,
            policy=policy,
            clock=shared.clock,
            executor=read_pool,
            metrics=shared.metrics,
            read_delays={(s, g): d for s, g, d in config.debug_read_delay_s},
            ordered=ordered,
            readahead_wait_s=config.readahead_wait_s,
        ),
        clock=shared.clock,
        workers=config.workers,
        time_slice_s=config.time_slice_s,
        **fair_only,
        mailbox_size=config.mailbox_size,
        max_pending=config.max_pending_pulls,
        deadline_grace_s=config.pull_grace_s,
        metrics=shared.actor_metrics,
    )


def _delayed(
    shared: Shared, journal: Journal, scheduled: ScheduleRecovered, producer: ProduceService
) -> DelayedMessages:
    config = shared.config
    delayed = DelayedMessages(
        data_dir=config.data_dir,
        journal=journal,
        recovered=scheduled,
        store_due=producer.store_due,
        metrics=shared.schedule_metrics,
        clock=shared.clock,
        tick_us=int(config.schedule_tick_s * 1_000_000),
        load_ahead_us=int(config.schedule_load_ahead_s * 1_000_000),
    )
    producer.attach(delayed)
    shared.schedule_metrics.watch(delayed.snapshot)
    return delayed


def _maintenance(
    shared: Shared, journal: Journal, subjects: SubjectTable, groups: GroupTable
) -> Maintenance:
    config = shared.config
    return Maintenance(
        data_dir=config.data_dir,
        journal=journal,
        subjects=subjects,
        groups=groups,
        reader=shared.reader,
        clock=shared.clock,
        metrics=shared.metrics,
        retention_s=config.retention_s,
        dedup_window_s=config.dedup_window_s,
        checkpoint_interval_s=config.checkpoint_interval_s,
        retention_check_interval_s=config.retention_check_interval_s,
    )


def _console(shared: Shared, stats: StatsService, ordered: OrderedPulls) -> ConsoleService:
    config = shared.config
    return ConsoleService(
        lifecycle=shared.lifecycle,
        stats=stats,
        sampler=ConsoleSampler(
            stats=stats,
            fsync_seconds=shared.metrics.fsync_seconds,
            data_dir=config.data_dir,
            clock=shared.clock,
            history=History(capacity=CONSOLE_SAMPLES, max_series=CONSOLE_MAX_SERIES),
            interval_s=config.console_sample_interval_s,
        ),
        recent_consumers=shared.recent_consumers,
        ordered=ordered,
        clock=shared.clock,
    )
