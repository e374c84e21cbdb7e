"""The dispatcher's log events, all on the logger ``qmq_outbox.dispatcher``."""

from __future__ import annotations

import logging

from qmq_outbox.sending import SendReport

logger = logging.getLogger("qmq_outbox.dispatcher")


def log_report(report: SendReport, marked: int) -> None:
    if report.results:
        logger.debug(
            "sent %d message(s), marked %d row(s)",
            len(report.results),
            marked,
            extra={"action": "outbox.sent", "count": len(report.results), "marked": marked},
        )
    for message, error in report.rejected:  # only rejections of the message itself
        logger.error(
            "broker rejected message %s of subject %s: %s",
            message.id,
            message.subject,
            error,
            extra={"action": "outbox.rejected", "message_id": message.id, "code": error.code},
        )
    if report.error is not None:  # the outage itself is logged by Dispatch.broker
        logger.debug(
            "broker unavailable or refusing, %d message(s) held for another try: %s",
            len(report.unsent),
            report.error,
            extra={"action": "outbox.dispatch_failed", "count": len(report.unsent)},
        )


def log_skipped(count: int, why: str) -> None:
    logger.debug(
        "%s, %d message(s) left to the compensator",
        why,
        count,
        extra={"action": "outbox.dispatch_skipped", "count": count},
    )


def log_held(held: int, left: int) -> None:
    logger.debug(
        "%d keyed message(s) wait for an earlier row of their key, %d left to the compensator",
        held,
        left,
        extra={"action": "outbox.order_held", "count": held, "left": left},
    )


def log_drain_timeout(drain_timeout: float, left: int) -> None:
    logger.warning(
        "dispatcher did not drain within %.1fs; the rest stays pending",
        drain_timeout,
        extra={"action": "outbox.drain_timeout", "left": left},
    )
