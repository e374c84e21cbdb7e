"""Start a real broker subprocess for benchmarks (the same CLI users run)."""

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


class BenchBroker:
    """A ``qmq broker`` subprocess on a data directory, with its log beside it."""

    def __init__(self, data_dir: Path, *args: str, checkout: Path | None = None) -> None:
        """``checkout``: run the broker of that checkout of the repository (its code is
        imported from the working directory); default: this one."""
        self.data_dir = data_dir
        self.args = list(args)
        self.checkout = checkout
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir.parent / f"broker-{self.port}.log"

    def start(self, timeout: float = 120) -> float:
        """Start and wait until healthy; returns seconds until /healthz said 200."""
        began = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "qmq_outbox",
                    "broker",
                    "--data-dir",
                    str(self.data_dir),
                    "--port",
                    str(self.port),
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.checkout,
            )
        while time.monotonic() - began < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.01)
        raise TimeoutError("broker did not become healthy")

    def memory_mb(self) -> dict[str, float]:
        """VmRSS and VmHWM (the peak) of the broker process, in MB."""
        assert self.proc is not None
        out: dict[str, float] = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
        return out

    def rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill9()
