# SPDX-License-Identifier: Apache-2.0
"""The controller's own nats-server: with no --nats, `jobprobe controller` starts one with JetStream in its data
directory, listening on --listen — one command for a small cluster. With --partition I/N (N > 1) it maps each frame
to its job's partition (jobprobe/core/wire.py); the controllers of the other partitions connect to it with --nats.

It is authenticated (jobprobe/transport/natsauth.py: the controller's nkey and one per node enrolled with
`jobprobe controller enroll NODE`, whose permissions write_auth puts in the server's auth.conf), TLS or loopback
unless told otherwise, and gone with the controller. Supervised (supervise()): a server that exits while the
controller runs is started again after a backoff, its exit logged; /metrics counts the restarts.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from jobprobe.cluster.ingest import MAX_FRAME
from jobprobe.core.child import stop_child
from jobprobe.core.errors import BadInput
from jobprobe.core.libc import LIBC
from jobprobe.core.retry import Backoff
from jobprobe.core.wire import host_port, mappings_conf
from jobprobe.transport.credentials import is_loopback
from jobprobe.transport.natsauth import Auth, server_pid, write_secret

log = logging.getLogger("jobprobe.cluster.natsserver")

RESET_AFTER_S = 60.0    # a server that ran this long before it exited is restarted after the shortest delay again


class LocalNats:
    """A nats-server with JetStream, our child, its data under `data_dir` (the controller's one-command mode).

    Authenticated always (natsauth: the controller's nkey and every enrolled node's, with their permissions); TLS
    with `tls_cert`/`tls_key`; on an address that is not loopback, refused without TLS unless `insecure_plaintext`.
    It dies with the controller (PR_SET_PDEATHSIG: a SIGKILLed controller leaves no server behind); a server of an
    earlier controller of this data directory (its pid file) is stopped first, and anything else listening on the
    port is refused, never used."""

    def __init__(self, data_dir: str | Path, listen: str = "127.0.0.1:4222", tls_cert: str | None = None,
                 tls_key: str | None = None, insecure_plaintext: bool = False, partitions: int = 1):
        exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
        if not os.path.exists(exe):
            raise BadInput("nats-server is not installed (Debian package nats-server; scripts/setup.sh installs it)")
        host, port = host_port(listen, "--listen")
        if bool(tls_cert) != bool(tls_key):
            raise BadInput("--tls-cert and --tls-key go together")
        if not tls_cert and not insecure_plaintext and not is_loopback(host):
            raise BadInput(f"--listen {listen}: not loopback, and no TLS: give --tls-cert/--tls-key (agents then "
                           "take --nats-ca), or --insecure-plaintext on a network you trust")
        for f in (tls_cert, tls_key):
            if f and not os.path.exists(f):
                raise BadInput(f"{f}: no such file")
        self.url = f"{'tls' if tls_cert else 'nats'}://{'127.0.0.1' if host in ('', '0.0.0.0') else host}:{port}"
        self.data = Path(data_dir)
        self.data.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.data, 0o700)
        self.auth = Auth(self.data)
        self.creds = str(self.auth.controller_seed())
        self._stop_our_orphan()
        if _listening(host or "127.0.0.1", port):
            raise BadInput(f"--listen {listen}: something else listens there already; it is not this data "
                           "directory's nats-server (stop it, or give another --listen / --nats URL)")
        d = self.data / "nats"
        d.mkdir(exist_ok=True, mode=0o700)
        self.conf = self.data / "nats-server.conf"
        tls = (f'tls {{\n  cert_file: "{os.path.abspath(tls_cert)}"\n  key_file: "{os.path.abspath(tls_key)}"\n}}\n'
               if tls_cert else "")
        listen_at = f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}"
        self.conf.write_text(f'listen: "{listen_at}"\nmax_payload: {MAX_FRAME}\n'
                             f'pid_file: "{self.data / "nats-server.pid"}"\n'
                             f'jetstream {{\n  store_dir: "{d}"\n}}\n{tls}{mappings_conf(partitions)}'
                             'include "auth.conf"\n')
        write_auth(self.data)
        os.chmod(self.conf, 0o600)
        self.log = open(os.open(self.data / "nats-server.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                                0o600), "ab")
        self.exe, self.restarts = exe, 0
        self.lock = threading.Lock()         # stop() and a restart: never a server started after stop()
        self.stopping = threading.Event()
        self.watcher: threading.Thread | None = None
        self.proc = self._start()
        self.host, self.port = host or "127.0.0.1", port

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen([self.exe, "-c", str(self.conf)], stdin=subprocess.DEVNULL, stdout=self.log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)

    def supervise(self) -> None:
        """From now on (the server listening: wait()), a server that exits is started again, after a backoff
        (0.5 s, doubling with jitter to 30 s; short again once one ran RESET_AFTER_S), until stop(). The agents
        spool meanwhile and the controller's client reconnects: nothing is lost (tests/test_natsserver.py)."""
        self.watcher = threading.Thread(target=self._watch, name="nats-server", daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        # this thread forks every restarted server: PR_SET_PDEATHSIG fires when the forking *thread* ends, so it
        # lives as long as the servers it starts (until stop())
        backoff = Backoff(initial=0.5, maximum=30.0)
        while True:
            began = time.monotonic()
            proc = self.proc
            code = proc.wait()
            if self.stopping.is_set():
                return
            if time.monotonic() - began > RESET_AFTER_S:   # a rare crash comes back fast; a crash loop slows down
                backoff.reset()
            delay = backoff.next()
            log.warning("nats-server (pid %d) exited: %s; starting it again in %.1f s (%s)", proc.pid, _how(code),
                        delay, self.data / "nats-server.log")
            if self.stopping.wait(delay):
                return
            with self.lock:
                if self.stopping.is_set():
                    return
                try:
                    self.proc = self._start()
                except OSError as err:     # the binary gone, no memory to fork: tried again after the next delay
                    log.warning("nats-server: could not start it again: %s", err)
                    continue
                self.restarts += 1
            log.warning("nats-server started again (pid %d, restart %d)", self.proc.pid, self.restarts)

    def _stop_our_orphan(self) -> None:
        """A nats-server left by an earlier controller of this data directory (its pid file, its config) goes."""
        pid = server_pid(self.data, self.data / "nats-server.conf")
        if pid is not None:
            log.warning("stopping the nats-server (pid %d) an earlier controller of %s left running", pid, self.data)
            os.kill(pid, signal.SIGTERM)
            end = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and time.monotonic() < end:
                time.sleep(0.05)

    def wait(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise BadInput(f"nats-server exited with code {self.proc.returncode} (see "
                               f"{self.data / 'nats-server.log'})")
            if _listening(self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1", self.port):
                return
            time.sleep(0.05)
        raise BadInput(f"nats-server did not listen on {self.url} within {timeout:.0f} s")

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
        stop_child(self.proc, 10)
        if self.watcher is not None:
            self.watcher.join(10)
        self.log.close()


def _how(code: int) -> str:
    """A child's exit status in words: `code 1`, `killed by signal SIGKILL`."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def write_auth(data_dir: str | Path) -> Path:
    """auth.conf from the enrolled nodes (included by the server's config; enroll rewrites it and reloads)."""
    path = Path(data_dir, "auth.conf")
    write_secret(path, Auth(data_dir).server_config())
    return path


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the controller dies, however it dies (prctl PR_SET_PDEATHSIG)."""
    LIBC.prctl(1, signal.SIGTERM, 0, 0, 0)
