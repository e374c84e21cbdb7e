"""A FastAPI service that writes an order and publishes ``order.created`` in one transaction.

What must run beside it: the broker, and a compensator (``qmq compensator --database-url ...
--broker-url ...``; or, for a single worker, ``outbox.run_compensator(engine)`` in the
lifespan), which sends what the dispatcher could not (docs/outbox.md, "What must run").

    python -m examples.fastapi_app --database-url sqlite:///shop.db --broker-url http://127.0.0.1:8931
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"customer": "ada", "amount": "19.90"}'

The session dependency is FastAPI's usual one, ``with Session(engine) as session: yield
session``: ``outbox.install(engine)`` is all the outbox needs. The endpoint commits; a
request that fails before the commit (here: the customer's credit limit, checked after the
order is written) closes the session without committing, and the order, its outbox row and
the message all disappear together. ``POST /async/orders`` does the same with an
``AsyncSession`` from ``async_sessionmaker(async_engine)`` when an async engine is given.
The message body is a pydantic model holding a ``Decimal`` and a ``datetime``: the default
serializer writes them as ``"19.90"`` and RFC 3339.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations at
# runtime, and ``Depends(get_session)`` names a function local to ``create_app``.
import argparse
import contextlib
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated

import pydantic
from fastapi import Depends, FastAPI, HTTPException
from sqlalchemy import DateTime, Integer, Numeric, String, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from examples.orders.service import sqlite_engine
from qmq_outbox import Outbox
from qmq_outbox.migrate import upgrade


class Base(DeclarativeBase):
    pass


class ShopOrder(Base):
    __tablename__ = "shop_orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    customer: Mapped[str] = mapped_column(String(100))
    amount: Mapped[Decimal] = mapped_column(Numeric(12, 2))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class OrderIn(pydantic.BaseModel):
    customer: str = pydantic.Field(min_length=1, max_length=100)
    amount: Decimal = pydantic.Field(gt=0, max_digits=12, decimal_places=2)


class OrderPlaced(pydantic.BaseModel):
    """The response, and the body of ``order.created``."""

    order_id: int
    customer: str
    amount: Decimal
    created_at: datetime


class OrderOut(OrderPlaced):
    message_id: str


def prepare_database(engine: Engine) -> None:
    """Create the shop's table and migrate the qmq tables (as the app's deploy would)."""
    Base.metadata.create_all(engine)
    with engine.begin() as connection:
        upgrade(connection)


def _new_order(order: OrderIn) -> ShopOrder:
    return ShopOrder(customer=order.customer, amount=order.amount, created_at=datetime.now(UTC))


def _placed(row: ShopOrder) -> OrderPlaced:
    return OrderPlaced(
        order_id=row.id, customer=row.customer, amount=row.amount, created_at=row.created_at
    )


def _over_limit(outstanding: Decimal | None, credit_limit: Decimal) -> None:
    if (outstanding or Decimal(0)) > credit_limit:
        raise HTTPException(status_code=409, detail="credit limit exceeded")


def create_app(
    *,
    engine: Engine,
    broker_url: str,
    async_engine: AsyncEngine | None = None,
    credit_limit: Decimal = Decimal(1000),
) -> FastAPI:
    """The app; its lifespan installs the outbox on the engines and drains it at shutdown."""
    outbox = Outbox(broker_url=broker_url, app="shop")
    engines: list[Engine | AsyncEngine] = (
        [engine] if async_engine is None else [engine, async_engine]
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for each in engines:
            outbox.install(each)
        try:
            yield
        finally:
            for each in engines:
                outbox.uninstall(each)
            await outbox.aclose(drain_timeout=10)  # on the app's loop: drains both dispatchers

    app = FastAPI(title="shop", lifespan=lifespan)

    def get_session() -> Iterator[Session]:
        with Session(engine) as session:
            yield session

    @app.post("/orders", status_code=201)
    def place_order(order: OrderIn, session: Annotated[Session, Depends(get_session)]) -> OrderOut:
        row = _new_order(order)
        session.add(row)
        session.flush()  # assigns row.id
        placed = _placed(row)
        message_id = outbox.publish(session, "order.created", placed, key=str(row.id))
        outstanding = session.scalar(
            select(func.sum(ShopOrder.amount)).where(ShopOrder.customer == order.customer)
        )
        _over_limit(outstanding, credit_limit)  # raises: the session closes, all rolls back
        session.commit()
        return OrderOut(**placed.model_dump(), message_id=message_id)

    if async_engine is not None:
        async_sessions = async_sessionmaker(async_engine, expire_on_commit=False)

        async def get_async_session() -> AsyncIterator[AsyncSession]:
            async with async_sessions() as session:
                yield session

        @app.post("/async/orders", status_code=201)
        async def place_order_async(
            order: OrderIn, session: Annotated[AsyncSession, Depends(get_async_session)]
        ) -> OrderOut:
            row = _new_order(order)
            session.add(row)
            await session.flush()
            placed = _placed(row)
            message_id = outbox.publish(session, "order.created", placed, key=str(row.id))
            outstanding = await session.scalar(
                select(func.sum(ShopOrder.amount)).where(ShopOrder.customer == order.customer)
            )
            _over_limit(outstanding, credit_limit)
            await session.commit()
            return OrderOut(**placed.model_dump(), message_id=message_id)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    import uvicorn  # the broker extra; only the runnable example needs it

    engine = sqlite_engine(args.database_url)  # any URL; SQLite files get WAL and a busy timeout
    prepare_database(engine)
    uvicorn.run(create_app(engine=engine, broker_url=args.broker_url), port=args.port)


if __name__ == "__main__":
    main()
