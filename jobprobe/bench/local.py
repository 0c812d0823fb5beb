# SPDX-License-Identifier: Apache-2.0
"""What the benches start on this machine: shell commands, waits, a free loopback port and a nats-server (the tests
start theirs from here too)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from jobprobe.core.child import stop_child


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def until(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """cond()'s first truthy value within `timeout` s; else AssertionError naming `what`."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nats:
    """A nats-server with JetStream on a free loopback port, its data under `base` (started by start())."""

    def __init__(self, base: Path):
        self.base, self.port = base, free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, auth: str = "") -> None:
        """`auth`: more of the server's configuration (an authorization block)."""
        conf = self.base / "nats.conf"
        conf.write_text(f'listen: "127.0.0.1:{self.port}"\njetstream {{ store_dir: "{self.base / "js"}" }}\n{auth}')
        exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
        self.proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        until(self.listening, 10, "nats-server to listen")

    def listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, 10)
