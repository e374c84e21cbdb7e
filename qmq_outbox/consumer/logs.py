"""The consumer's log events (one text each) and small policies."""

from __future__ import annotations

import logging
from typing import Any

from qmq_outbox.backoff import backoff_ceiling, equal_jitter
from qmq_outbox.consumer.config import ConsumerConfig
from qmq_outbox.envelope import Message
from qmq_outbox.errors import BrokerUnavailable
from qmq_outbox.failure_log import FailureLog, RepeatedFailures, delivery, describe

logger = logging.getLogger("qmq_outbox.consumer")

FINAL_ACK_ATTEMPTS = 3
HANDLER_FAILURE_LINES = 5  # a group's failures written in full before the summaries
STOPPED_ERROR = "consumer stopped before handling"


def backoff(failures: int, *, cap: float = 5.0) -> float:
    """0.1 s, 0.2 s, 0.4 s ... up to ``cap``: the longest pause after ``failures`` in a row."""
    return backoff_ceiling(failures, base=0.1, cap=cap)


def retry_pause(failures: int) -> float:
    """The pause before retrying the broker: ``backoff``, jittered so that the consumers of
    a group do not all come back at the same instant."""
    return equal_jitter(backoff(failures))


def broker_failures(cfg: ConsumerConfig, target: str, *, summary_interval: float) -> FailureLog:
    """The broker's outages as this consumer's pullers and acker see them (their sources)."""
    return FailureLog(
        what=f"consumer {cfg.group}: broker",
        target=target,
        action="consumer.broker",
        logger=logger,
        expected=(BrokerUnavailable,),
        summary_interval=summary_interval,
        fields={"group": cfg.group, "consumer": cfg.consumer_id},
    )


def handler_failures(cfg: ConsumerConfig) -> RepeatedFailures:
    """The group's handler failures: the first few in full, then a summary per interval."""
    return RepeatedFailures(
        what=f"consumer group {cfg.group}: handler",
        action="consumer.handler_failed",
        logger=logger,
        first_lines=HANDLER_FAILURE_LINES,
        summary_interval=cfg.outage_summary,
        fields={"group": cfg.group, "consumer": cfg.consumer_id},
    )


def log_handler_failed(
    failures: RepeatedFailures, cfg: ConsumerConfig, message: Message, exc: BaseException
) -> None:
    failures.failed(delivery(message), exc, extra=ids(cfg, message) | {"attempt": message.attempt})


def ids(cfg: ConsumerConfig, message: Message) -> dict[str, Any]:
    return {
        "group": cfg.group,
        "subject": message.subject,
        "seq": message.seq,
        "message_id": message.id,
    }


def log_ack_failed(cfg: ConsumerConfig, subject: str, seqs: list[int], exc: Exception) -> None:
    logger.warning(
        "consumer group %s: ack of subject %s, seqs %s rejected by the broker; those "
        "leases will expire: %s",
        cfg.group,
        subject,
        _seqs(seqs),
        describe(exc),
        extra={
            "action": "consumer.ack_failed",
            "group": cfg.group,
            "subject": subject,
            "count": len(seqs),
            "error": describe(exc),
        },
    )


def log_dropped(cfg: ConsumerConfig, unsent: dict[str, list[int]]) -> None:
    logger.error(
        "consumer group %s: %d ack(s) dropped at stop (%s); those messages will be redelivered",
        cfg.group,
        sum(len(seqs) for seqs in unsent.values()),
        "; ".join(f"subject {subject}, seqs {_seqs(seqs)}" for subject, seqs in unsent.items()),
        extra={
            "action": "consumer.acks_dropped",
            "group": cfg.group,
            "count": sum(len(seqs) for seqs in unsent.values()),
        },
    )


def log_ack_unknown(cfg: ConsumerConfig, subject: str, seqs: list[int]) -> None:
    logger.info(
        "consumer group %s: acks of subject %s, seqs %s for leases the broker no longer "
        "holds for us (expired or redelivered)",
        cfg.group,
        subject,
        _seqs(seqs),
        extra={
            "action": "consumer.ack_unknown",
            "group": cfg.group,
            "subject": subject,
            "seqs": seqs[:20],
        },
    )


def _seqs(seqs: list[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, seqs[:limit]))
    return shown + (f" and {len(seqs) - limit} more" if len(seqs) > limit else "")
