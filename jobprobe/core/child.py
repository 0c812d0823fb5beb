# SPDX-License-Identifier: Apache-2.0
"""Stopping a child process within a time: asked first (SIGTERM, or the signal given), killed when it does not exit,
and reaped either way. The controller's own nats-server and the benchmarks' agents, controllers and peer tools
stop this way."""
from __future__ import annotations

import signal
import subprocess


def stop_child(proc: subprocess.Popen, timeout: float, sig: int = signal.SIGTERM) -> None:
    """`sig` to `proc` unless it has exited, then up to `timeout` s for it to exit; SIGKILL past that. Returns once
    it is reaped (its returncode set)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
