# SPDX-License-Identifier: Apache-2.0
"""The node's sinks, shared by the node agent's jobs (NodeSinks, a part the Agent holds): the NATS sink (frames to the
controller's JetStream through an on-disk spool; it also serves the node's control subject, answered by the `remote`
callable it is given) and the Prometheus endpoint; the one thread that writes every job's --out file; each job's
sinks made from them and the agent's settings (for_job: --out files, stdout, NATS, Prometheus); the node's heartbeat
to the controller, each tick.

Its interface to the agent is its constructor's arguments (the settings, the host, `remote`) and the methods below;
it holds no reference to the agent.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from jobprobe.core.errors import BadInput
from jobprobe.core.frame import NODE_JOB, FrameBuilder
from jobprobe.exporters.file import FileSink, job_path
from jobprobe.exporters.queued import QueuedSink, SinkWorker
from jobprobe.exporters.stdout import StdoutSink
from jobprobe.kernel.host import Host
from jobprobe.node.config import Config

log = logging.getLogger("jobprobe.node.agent")


class NodeSinks:
    """The node's NATS and Prometheus sinks, the file writer, each job's sinks, the heartbeat."""

    def __init__(self, cfg: Config, host: Host, remote: Callable[[bytes], bytes]):
        """The NATS sink (cfg.nats, serving the node's control subject with `remote`) and the Prometheus endpoint
        (cfg.prometheus); None where not asked for. BadInput for credentials that cannot be used."""
        self.cfg, self.host = cfg, host
        self.file_writer = SinkWorker("files")    # one thread writes every job's --out file
        self.nats = None
        if cfg.nats:
            from jobprobe.core.wire import control_subject
            from jobprobe.exporters.nats import NatsSink
            try:
                self.nats = NatsSink(cfg.nats, cfg.spool, int(cfg.spool_max_mb * (1 << 20)), creds=cfg.nats_creds,
                                     tls_ca=cfg.nats_ca, node=host.node,
                                     allow_plaintext_password=cfg.nats_insecure_plaintext)
            except (OSError, ValueError) as err:     # credentials unreadable or malformed, a password in clear
                raise BadInput(f"nats: {err}") from None
            self.nats.serve(control_subject(host.node), remote)   # the controller's cluster-wide traces
        self.prom = None
        if cfg.prometheus:
            from jobprobe.contract.probe import schema_of
            from jobprobe.exporters.prometheus import PromSink, owner_names
            from jobprobe.node.registry import all_probes
            # every probe's declarations, meanings included: HELP lines, and the fields of a probe switched on
            # for a job while it runs (its hello named only the probes it started with)
            self.prom = PromSink(cfg.prometheus, cfg.prometheus_max_jobs, owner_names(cfg.prometheus_labels),
                                 declared=schema_of(all_probes().values(), docs=True))
        # the node's heartbeats: a run id of their own (a job may be named "node": its frames' keys stay apart)
        self.beat = FrameBuilder(host.node, NODE_JOB) if self.nats is not None else None
        self._beat_lock = threading.Lock()

    def file_of(self, job: str) -> dict[str, str]:
        """{"file": the job's frame file} where the agent writes one (--out) and it exists; else {}."""
        try:
            path = job_path(self.cfg.out, job) if self.cfg.out else ""
        except ValueError:
            return {}
        return {"file": path} if path and os.path.exists(path) else {}

    def for_job(self, job: str) -> list:
        """The job's sinks, from the settings: its --out file, stdout, the node's NATS and Prometheus sinks."""
        out: list = []
        if self.cfg.out:
            try:
                path = job_path(self.cfg.out, job)       # one file per job (an injective name), 0700 directory
                out.append(QueuedSink(FileSink(path, self.cfg.out_max_mb), f"file:{path}", self.cfg.queue,
                                      self.file_writer))
            except ValueError as err:
                raise BadInput(f"job {job!r}: {err}") from None
            except OSError as err:
                raise BadInput(f"cannot write {self.cfg.out} for job {job!r}: {err.strerror}") from err
        if self.cfg.stdout:
            out.append(QueuedSink(StdoutSink(self.cfg.stdout), "stdout", self.cfg.queue))
        if self.nats is not None:
            out.append(self.nats.for_job(job))   # appends to the node's spool: no queue of its own needed
        if self.prom is not None:
            out.append(self.prom.for_job(job))   # updates a few totals under a lock: no queue needed
        return out

    def heartbeat(self, jobs: int, stopping: bool = False) -> None:
        """The node's liveness to every controller, with or without jobs (a job's frames reach only its own
        partition's controller): a heartbeat frame each tick, saying how many jobs are attached; `stopping`, once,
        at a clean stop (then no more)."""
        with self._beat_lock:
            if self.beat is None:
                return
            beat = self.beat.heartbeat(time.time(), self.cfg.interval, jobs, stopping)
            if stopping:
                self.beat = None
        try:
            self.nats.heartbeat(beat)
        except Exception as err:     # the spool's disk: the next tick tries again
            log.warning("heartbeat: %s: %s", type(err).__name__, err)

    def close(self) -> None:
        """The NATS sink (its spool flushed) and the Prometheus endpoint."""
        if self.nats is not None:
            self.nats.close()
        if self.prom is not None:
            self.prom.close()
