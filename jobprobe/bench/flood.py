# SPDX-License-Identifier: Apache-2.0
"""One node flooding the controller while two others work: `python -m jobprobe.bench.flood` (docs/PERFORMANCE.md).

A real nats-server on loopback and `jobprobe controller` as a process; two honest nodes publish a frame every 0.2 s
(stamped with the time it was sent) the whole run, while a third, in turn: publishes one small sample for each of
`names` job names as fast as it can (node `bad`); `garbage_s` seconds of garbage frames (node `junk`); `beats_s`
seconds of 1 MiB heartbeats (on `bad`'s beat subject); `big` valid event frames of ~0.7 MB (node `big`).
Measured: the controller's peak RSS (VmHWM), the honest
frames' worst delay (stored − sent, from the store), every honest frame stored once, `rejects` rows and bytes, the
store's growth, refusals by reason.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Iterator

from jobprobe.bench.overhead import free_port, scratch
from jobprobe.core.frame import encode
from jobprobe.core.wire import beat_subject, frames_subject, msg_id

NATS = "nats-server"


def frame(node: str, job: str, seq: int, t: float, kind: str = "sample", **extra) -> dict:
    f = {"v": 1, "kind": kind, "node": node, "job": job, "run": "r1", "seq": seq, "t": t, "dt": 1.0, **extra}
    if kind == "sample":
        f.update(probes={"cgroup": {"cpu_user_ns": 4 * 10 ** 8 + seq, "mem_bytes": 1 << 30}},
                 status={"cgroup": "ok"})
    return f


def status_mib(pid: int, field: str) -> float:
    """A memory figure of a process (`VmHWM`: its peak RSS; `VmRSS`: now) from /proc/PID/status, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


@contextlib.contextmanager
def read_only(db: Path) -> Iterator[sqlite3.Connection]:
    """The store as a reader beside the controller writing it: read-only, closed after."""
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        yield c
    finally:
        c.close()


def count(db: Path, sql: str) -> int:
    """One COUNT(*) of the store."""
    with read_only(db) as c:
        return c.execute(sql).fetchone()[0]


@contextlib.contextmanager
def controller_site(work: Path, max_payload: int | None = None) -> Iterator[tuple[str, Path, subprocess.Popen]]:
    """A nats-server on loopback (JetStream under `work`) and `jobprobe controller` as a process consuming it:
    (its URL, the store's path, the controller's process), both stopped after — the controller first, SIGTERM
    (its last batch acked), then the server."""
    port = free_port()
    conf = work / "nats.conf"
    conf.write_text(f'listen: "127.0.0.1:{port}"\n' + (f"max_payload: {max_payload}\n" if max_payload else "")
                    + f'jetstream {{ store_dir: "{work / "js"}" }}\n')
    server = subprocess.Popen([NATS, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, db, log = f"nats://127.0.0.1:{port}", work / "store.db", work / "controller.log"
    ctl = None
    try:
        _wait(lambda: listening(port), 10, "nats-server")
        ctl = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "controller", "--nats", url, "--store", str(db)],
                               stdout=subprocess.DEVNULL, stderr=open(log, "ab"))
        _wait(lambda: "consuming" in log.read_text(), 30, "the controller to consume")
        yield url, db, ctl
    finally:
        if ctl is not None and ctl.poll() is None:
            ctl.send_signal(signal.SIGTERM)
            try:
                ctl.wait(timeout=30)
            except subprocess.TimeoutExpired:
                ctl.kill()
        server.terminate()
        server.wait(timeout=10)


@contextlib.contextmanager
def set_on_exit(event: threading.Event) -> Iterator[None]:
    """`event` set when the block ends, however it ends (the bench's threads stop)."""
    try:
        yield
    finally:
        event.set()


def flood(names: int = 10_000, garbage_s: float = 30.0, beats_s: float = 15.0, big: int = 60,
          garbage_rate: float = 11_400.0, progress=None) -> dict:
    """garbage_rate: garbage frames a second (11 400: the rate that once added 342 600 `rejects` rows in 30 s;
    0: as fast as the server takes them)."""
    with scratch(None, "jobprobe-bench-flood-") as work:
        return _flood(Path(work), names, garbage_s, beats_s, big, garbage_rate, progress)


def _flood(work: Path, names: int, garbage_s: float, beats_s: float, big: int, rate: float, progress) -> dict:
    from jobprobe.transport.natswire import Wire
    say = (lambda s: (progress.write(s + "\n"), progress.flush())) if progress else (lambda s: None)
    stop = threading.Event()
    sent: dict[str, int] = {"h1": 0, "h2": 0}
    with controller_site(work, max_payload=2097152) as (url, db, ctl), set_on_exit(stop):
        base = os.path.getsize(db)

        def honest(node: str) -> None:
            w = Wire(url, name=node)
            w.connect()
            try:
                while not stop.is_set():
                    f = frame(node, f"train-{node}", sent[node], time.time())
                    m = (frames_subject(node, f["job"]), msg_id(f), zlib.compress(encode(f)))
                    while True:      # as an agent does: the same frame again until acked (its id: stored once)
                        try:
                            w.publish([m], timeout=10)
                            break
                        except Exception:
                            w.close()
                            time.sleep(0.5)
                            w.connect()
                    sent[node] += 1
                    stop.wait(0.2)
            finally:
                w.close()
        threads = [threading.Thread(target=honest, args=(n,), daemon=True) for n in sent]
        for t in threads:
            t.start()
        peak = [0.0]

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], status_mib(ctl.pid, "VmHWM"))
                stop.wait(0.2)
        threading.Thread(target=watch, daemon=True).start()
        bad = Wire(url, name="bad")
        bad.connect()
        t0 = time.time()
        for i in range(0, names, 500):       # one small sample for each of `names` job names
            fs = [frame("bad", f"job{k}", 0, time.time()) for k in range(i, min(names, i + 500))]
            bad.publish([(frames_subject("bad", f["job"]), msg_id(f), encode(f)) for f in fs], timeout=30)
        say(f"{names} job names in {time.time() - t0:.1f} s")
        rng, n, start = random.Random(5), 0, time.time()
        while time.time() < start + garbage_s:      # garbage: random bytes, each with a message id of its own
            if rate and n > rate * (time.time() - start):
                time.sleep(0.005)
                continue
            bad.publish([(frames_subject("junk", "j"), f"g/{n + k}", rng.randbytes(rng.randrange(1, 300)))
                         for k in range(100)], timeout=30)
            n += 100
        say(f"{n} garbage frames in {garbage_s:.0f} s")
        huge, nb, end = b"\x81" + os.urandom(1 << 20), 0, time.time() + beats_s
        plain = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))   # core NATS: no stream, no
        plain.recv(4096)                                           # ack — the controller's subscription's way
        plain.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
        while time.time() < end:            # heartbeats of 1 MiB
            plain.sendall(b"PUB %s %d\r\n%s\r\n" % (beat_subject("bad").encode(), len(huge), huge))
            nb += 1
            time.sleep(0.005)
        # PING, then its PONG read before the close: the server answers in order, so every beat before it was
        # taken. Closing with the server's answers unread sends a reset, and the kernel then drops what the server
        # had not read yet (a fresh-clone run lost the last 1-2 beats of 567 so, counted nowhere).
        plain.sendall(b"PING\r\n")
        plain.settimeout(60)
        said = b""
        while b"PONG" not in said:
            got = plain.recv(65536)
            if not got:
                break
            said = (said + got)[-64:]
        plain.close()
        say(f"{nb} heartbeats of 1 MiB in {beats_s:.0f} s")
        blob = ["x" * 50_000] * 14          # strings are bounded at 64 KiB each
        for k in range(big):                # valid event frames near the largest a frame may be
            f = frame("big", "j", k, time.time(), kind="event", event="note", text=blob)
            bad.publish([(frames_subject("big", "j"), msg_id(f), encode(f))], timeout=30)
        bad.close()
        say(f"{big} event frames of ~0.7 MB")
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(timeout=15)
        want = sum(sent.values())

        _wait(lambda: count(db, "SELECT COUNT(*) FROM frames WHERE node IN ('h1', 'h2')") >= want, 120,
              "every honest frame stored")
        time.sleep(1.0)
        peak[0] = max(peak[0], status_mib(ctl.pid, "VmHWM"))
        alive = ctl.poll() is None
        with read_only(db) as c:
            delay = c.execute("SELECT MAX(received - t), COUNT(*), COUNT(DISTINCT node || seq) FROM frames "
                              "WHERE node IN ('h1', 'h2')").fetchone()
            rejects = c.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(subject) + LENGTH(reason) + "
                                "COALESCE(LENGTH(body), 0) + 24), 0) FROM rejects").fetchone()
            counts = {f"{n} {r}": k for n, r, k in c.execute("SELECT node, reason, SUM(n) FROM reject_counts "
                                                                   "GROUP BY node, reason")}
            bad_stored = c.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(body)), 0) FROM frames "
                                   "WHERE node IN ('bad', 'junk', 'big') AND run != 'controller'").fetchone()
        return {"alive": alive, "peak_rss_mib": round(peak[0], 1), "honest_sent": want, "honest_stored": delay[1],
                "honest_distinct": delay[2], "honest_worst_delay_s": round(delay[0], 3),
                "rejects_rows": rejects[0], "rejects_bytes": rejects[1], "refused": counts,
                "bad_stored": bad_stored[0], "bad_stored_bytes": bad_stored[1],
                "store_growth_mib": round((os.path.getsize(db) + _size(f"{db}-wal") - base) / (1 << 20), 1),
                "garbage": n, "beats": nb}


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on loopback `port` (a server started, not yet ready)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


if __name__ == "__main__":
    import json
    print(json.dumps(flood(progress=sys.stderr), indent=1))
