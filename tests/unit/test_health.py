"""/healthz answers 503 while the broker recovers and 200 after; other calls wait with 503."""

from __future__ import annotations

from pathlib import Path

import httpx

from qmq_broker.config import BrokerConfig
from qmq_broker.server import build


async def test_health_is_503_until_recovery_finishes(tmp_path: Path) -> None:
    broker, app = build(BrokerConfig(data_dir=tmp_path))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.get("/healthz")
        assert response.status_code == 503
        assert response.json() == {"status": "recovering"}
        produce = await client.post(
            "/v1/messages", json={"messages": [{"id": "1", "subject": "a", "body": "x"}]}
        )
        assert produce.status_code == 503
        assert produce.json()["error"]["code"] == "recovering"
        await broker.start()
        try:
            assert (await client.get("/healthz")).json() == {"status": "ok"}
        finally:
            await broker.close()
        stopped = await client.post(
            "/v1/messages", json={"messages": [{"id": "1", "subject": "a", "body": "x"}]}
        )
        assert stopped.status_code == 503
        assert stopped.json()["error"]["code"] == "shutting_down"
