"""The consumer's log events (one text each) and small policies."""

from __future__ import annotations

import logging
from typing import Any

from qmq_outbox.consumer.config import ConsumerConfig
from qmq_outbox.envelope import Message

logger = logging.getLogger("qmq_outbox.consumer")

FINAL_ACK_ATTEMPTS = 3
STOPPED_ERROR = "consumer stopped before handling"


def backoff(failures: int, *, cap: float = 5.0) -> float:
    """0.1 s, 0.2 s, 0.4 s ... up to ``cap``."""
    return float(min(cap, 0.1 * 2 ** max(0, failures - 1)))


def ids(cfg: ConsumerConfig, message: Message) -> dict[str, Any]:
    return {
        "group": cfg.group,
        "subject": message.subject,
        "seq": message.seq,
        "message_id": message.id,
    }


def log_pull_failed(cfg: ConsumerConfig, subject: str, exc: Exception, failures: int) -> None:
    logger.warning(
        "pull failed; retrying",
        extra={
            "action": "consumer.pull_failed",
            "group": cfg.group,
            "subject": subject,
            "failures": failures,
            "error": str(exc),
        },
    )


def log_ack_failed(cfg: ConsumerConfig, subject: str, seqs: list[int], exc: Exception) -> None:
    logger.warning(
        "ack failed",
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
