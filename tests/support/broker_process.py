"""A real broker in a subprocess, started with the `qmq broker` CLI, killable with SIGKILL."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class BrokerProcess:
    """Start, kill -9, SIGTERM and restart a broker on a fixed data dir and port."""

    def __init__(self, data_dir: Path, *, extra_args: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"broker-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, wait: bool = True, timeout: float = 30.0) -> BrokerProcess:
        cmd = [
            sys.executable,
            "-m",
            "qmq_outbox",
            "broker",
            "--data-dir",
            str(self.data_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        env = {k: v for k, v in os.environ.items() if not k.startswith("QMQ_BROKER_")}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        if wait:
            self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"broker not healthy after {timeout}s: {self.log_tail()}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def restart(self) -> BrokerProcess:
        """Start again after ``kill9`` or ``terminate`` (a live one would keep the port)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("the broker is still running: kill9() or terminate() it first")
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
