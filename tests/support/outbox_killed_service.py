"""A service that commits a transaction with messages and is SIGKILLed right after COMMIT.

``python -m tests.support.outbox_killed_service DB_URL BROKER_URL SUBJECT COUNT`` prints the
published message ids, then commits. A listener installed after the outbox's runs on
``after_commit`` (COMMIT has returned; the outbox has not handed anything to its dispatcher
yet: that happens in ``after_transaction_end``) and kills the process with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox.outbox import Outbox


def main(db_url: str, broker_url: str, subject: str, count: int) -> None:
    engine = sa.create_engine(db_url)
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker_url, app="doomed")
    outbox.install(maker)

    def die(session: Session) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    sa.event.listen(maker, "after_commit", die)
    with maker.begin() as session:
        ids = [outbox.publish(session, subject, {"n": n}) for n in range(count)]
        print("\n".join(ids), flush=True)
    print("survived", flush=True)  # never reached


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
