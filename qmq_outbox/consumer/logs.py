"""The consumer's log events (one text each) and small policies."""

from __future__ import annotations

import logging
from typing import Any

from qmq_outbox.backoff import backoff_ceiling, equal_jitter
from qmq_outbox.consumer.config import ConsumerConfig
from qmq_outbox.envelope import Message
from qmq_outbox.errors import BrokerUnavailable
from qmq_outbox.failure_log import FailureLog

logger = logging.getLogger("qmq_outbox.consumer")

FINAL_ACK_ATTEMPTS = 3
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


def ids(cfg: ConsumerConfig, message: Message) -> dict[str, Any]:
    return {
        "group": cfg.group,
        "subject": message.subject,
        "seq": message.seq,
        "message_id": message.id,
    }


def log_ack_failed(cfg: ConsumerConfig, subject: str, seqs: list[int], exc: Exception) -> None:
    logger.warning(
        "ack rejected by the broker; those leases will expire: %s",
        exc,
        extra={
            "action": "consumer.ack_failed",
            "group": cfg.group,
            "subject": subject,
            "count": len(seqs),
            "error": str(exc),
        },
    )


def log_dropped(cfg: ConsumerConfig, unsent: dict[str, list[int]]) -> None:
    logger.error(
        "acks dropped at stop; those messages will be redelivered",
        extra={
            "action": "consumer.acks_dropped",
            "group": cfg.group,
            "count": sum(len(seqs) for seqs in unsent.values()),
        },
    )


def log_ack_unknown(cfg: ConsumerConfig, subject: str, seqs: list[int]) -> None:
    logger.info(
        "acks for leases the broker no longer holds for us (expired or redelivered)",
        extra={
            "action": "consumer.ack_unknown",
            "group": cfg.group,
            "subject": subject,
            "seqs": seqs[:20],
        },
    )
