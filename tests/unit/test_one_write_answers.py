"""An answer's head and body leave in one write (``connections._OneWriteAnswers``).

Pure logic against a recording transport; every HTTP test of a real broker goes through
it too.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from qmq_broker.http.connections import _OneWriteAnswers


class Recording:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def answers(transport: Recording, cycle: Any, loop: asyncio.AbstractEventLoop) -> Any:
    return _OneWriteAnswers(cast(Any, transport), cycle, loop)


def test_the_head_waits_for_the_body_and_both_go_in_one_write() -> None:
    async def main() -> list[bytes]:
        transport, cycle = Recording(), SimpleNamespace(response_started=False)
        writer = answers(transport, cycle, asyncio.get_running_loop())
        cycle.response_started = True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        assert transport.writes == []
        writer.write(b"{}")
        await asyncio.sleep(0)  # the fallback flush finds nothing left
        return transport.writes

    assert asyncio.run(main()) == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]


def test_a_head_whose_body_is_late_goes_on_the_next_turn_of_the_loop() -> None:
    async def main() -> list[bytes]:
        transport, cycle = Recording(), SimpleNamespace(response_started=True)
        writer = answers(transport, cycle, asyncio.get_running_loop())
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await asyncio.sleep(0)
        assert len(transport.writes) == 1, "a streamed answer's head is not held back"
        writer.write(b"5\r\nhello\r\n")
        writer.write(b"0\r\n\r\n")
        return transport.writes

    writes = asyncio.run(main())
    assert writes[1:] == [b"5\r\nhello\r\n", b"0\r\n\r\n"]


def test_writes_before_the_answer_starts_go_at_once() -> None:
    async def main() -> list[bytes]:
        transport, cycle = Recording(), SimpleNamespace(response_started=False)
        writer = answers(transport, cycle, asyncio.get_running_loop())
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return transport.writes

    assert asyncio.run(main()) == [b"HTTP/1.1 100 Continue\r\n\r\n"]


def test_a_connection_closed_with_the_head_held_drops_it() -> None:
    async def main() -> Recording:
        transport, cycle = Recording(), SimpleNamespace(response_started=True)
        writer = answers(transport, cycle, asyncio.get_running_loop())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n")
        writer.close()  # the app failed after starting its answer
        await asyncio.sleep(0)
        assert writer.is_closing()
        return transport

    transport = asyncio.run(main())
    assert transport.writes == []
    assert transport.closed
