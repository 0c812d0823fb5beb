# SPDX-License-Identifier: Apache-2.0
"""Which controller of a partition is active: a lease, held as a key in a JetStream key-value bucket.

Two controllers (or more) may run for one partition; the one that holds the lease consumes, the others stand by.
The bucket `jobprobe_leases` keeps each key for LEASE_S (its max age: a key not written for that long is gone); the
key is `p<I>` (`p0` unpartitioned), its value who holds it.

- A controller takes the lease by *creating* the key: the server lets exactly one create succeed; the others see it
  exists and stand by, trying again every TRY_S.
- The holder renews it every RENEW_S by *updating* it against the revision it last wrote (compare-and-set): an update
  after someone else took the key fails, and the old holder knows it lost the lease.
- The holder counts its lease valid until LEASE_S − MARGIN_S after it *sent* its last successful write (the server
  wrote it later, so the key lives at least that long): it stops taking frames before the key can expire and a
  standby create it — never two active at once, even when its server is unreachable and it cannot ask.
- A holder that dies stops renewing: within LEASE_S the key is gone and a standby takes it, then the durable
  consumer's position (what was not acked is delivered again). A holder that stops cleanly deletes the key: the
  standby takes over at its next try. A controller restarted on the holder's host whose holder process is gone (a
  crash, then systemd's restart) takes the lease at once rather than waiting for it to expire.
- Each taking gets a fencing token (`token`), larger for every newer holder: the store refuses a write whose token
  is not the newest (jobprobe/cluster/store.py take_fence), so a holder paused past its lease and woken writes
  nothing. It is the KV revision of the taking write (the bucket's stream sequence: it only grows) plus the
  bucket's creation time (s since 2020) × 2^32: a bucket made again (JetStream's data lost) starts its revisions at
  1 again, but its tokens are still the larger — the old bucket's revisions grew by far less than 2^32 a second.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

log = logging.getLogger("jobprobe.cluster.lease")

BUCKET = "jobprobe_leases"
LEASE_S = 5.0       # a lease not renewed for this long is gone
RENEW_S = 1.0       # the holder renews this often
TRY_S = 1.0         # a standby tries to take it this often
MARGIN_S = 1.0      # the holder stops this long before its lease could expire
EPOCH_2020 = 1577836800     # the fencing token counts the bucket's creation time from 2020-01-01 (UNIX s)


class Lease:
    def __init__(self, js: Any, key: str, replicas: int = 1, holder: str | None = None):
        self.js, self.key, self.replicas = js, key, replicas
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self.kv: Any = None
        self.rev: int | None = None      # the revision we last wrote (None: not ours)
        self.epoch = 0                   # the bucket's creation time, s since 2020 (open)
        self.token = 0                   # the fencing token of our last taking (take)
        self.until = 0.0                 # monotonic: the lease is ours until then
        self.next_renew = 0.0

    async def open(self) -> None:
        """The bucket (made when missing; the same settings from every controller)."""
        from nats.js.errors import BucketNotFoundError, NotFoundError
        try:
            self.kv = await self.js.key_value(BUCKET)
        except (BucketNotFoundError, NotFoundError):
            self.kv = await self.js.create_key_value(bucket=BUCKET, ttl=LEASE_S, history=1,
                                                     replicas=self.replicas)
        created = (await self.js.stream_info(f"KV_{BUCKET}")).created
        self.epoch = max(0, int(created.timestamp()) - EPOCH_2020) if created else 0

    def held(self) -> bool:
        return self.rev is not None and time.monotonic() < self.until

    async def take(self) -> bool:
        """Try to become the holder: True when the key was free and is now ours."""
        sent = time.monotonic()
        try:
            self.rev = await self.kv.create(self.key, self.holder.encode())
        except Exception as err:       # the key exists (someone holds it), or the server is not there
            if "wrong last sequence" not in str(err).lower() and "exists" not in str(err).lower():
                log.warning("lease %s: %s: %s", self.key, type(err).__name__, err)
            self.rev = await self._from_dead_predecessor()
            if self.rev is None:
                return False
        self.until, self.next_renew = sent + LEASE_S - MARGIN_S, sent + RENEW_S
        self.token = (self.epoch << 32) + self.rev     # < 2^63, SQLite's largest INTEGER, until 2088
        return True

    def drop(self) -> None:
        """The lease is someone else's (the store's fence said so): forgotten without touching the key."""
        self.rev, self.until = None, 0.0

    async def _from_dead_predecessor(self) -> int | None:
        """The lease, when its holder was a process of this host that no longer runs (its revision then), else
        None."""
        try:
            entry = await self.kv.get(self.key)
            host, pid, _ = entry.value.decode().split(":")
            if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                return None
            rev = await self.kv.update(self.key, self.holder.encode(), last=entry.revision)
        except Exception:
            return None
        log.warning("lease %s: its holder (pid %s, this host) is gone: taken over at once", self.key, pid)
        return rev

    async def keep(self) -> bool:
        """Renew when due; whether the lease is still ours. A write refused (someone else's key now) ends it at
        once; a server that does not answer ends it when `until` passes."""
        now = time.monotonic()
        if self.rev is None or now < self.next_renew:
            return self.held()
        try:
            self.rev = await self.kv.update(self.key, self.holder.encode(), last=self.rev)
            self.until, self.next_renew = now + LEASE_S - MARGIN_S, now + RENEW_S
        except Exception as err:
            if "wrong last sequence" in str(err).lower():
                log.warning("lease %s: taken by another controller", self.key)
                self.rev = None
            else:
                log.warning("lease %s: not renewed: %s: %s", self.key, type(err).__name__, err)
                self.next_renew = now + RENEW_S / 4
        return self.held()

    async def release(self) -> None:
        """A clean stop: the key deleted (only if still ours), so that a standby takes over at its next try."""
        if self.rev is None:
            return
        try:
            await self.kv.delete(self.key, last=self.rev)
        except Exception as err:
            log.warning("lease %s: not released (it expires in %.0f s): %s", self.key, LEASE_S, err)
        self.rev = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
