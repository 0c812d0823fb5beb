# SPDX-License-Identifier: Apache-2.0
"""The node's sinks, shared by the node agent's jobs (NodeSinks, one part of the Agent): the NATS sink (frames to the
controller's JetStream through an on-disk spool; it also serves the node's control subject, answered by the agent's
remote()) and the Prometheus endpoint; each job's sinks made from them and the agent's settings (_default_sinks:
--out files, written by the agent's one file thread, stdout); the node's heartbeat to the controller while no job is
attached.

A mixin of Agent (jobprobe/node/agent.py): it uses the agent's cfg, host, lock, jobs, beat, file_writer and remote;
the agent calls _open_node_sinks when it is made.
"""
from __future__ import annotations

import logging
import os
import time

from jobprobe.core.errors import BadInput
from jobprobe.exporters.file import FileSink, job_path
from jobprobe.exporters.queued import QueuedSink
from jobprobe.exporters.stdout import StdoutSink

log = logging.getLogger("jobprobe.node.agent")


class NodeSinks:
    """The node's NATS and Prometheus sinks, each job's sinks, the heartbeat."""

    def _open_node_sinks(self) -> None:
        """The NATS sink (cfg.nats) and the Prometheus endpoint (cfg.prometheus); None where not asked for."""
        self.nats = None
        if self.cfg.nats:
            from jobprobe.core.wire import control_subject
            from jobprobe.exporters.nats import NatsSink
            try:
                self.nats = NatsSink(self.cfg.nats, self.cfg.spool, int(self.cfg.spool_max_mb * (1 << 20)),
                                     creds=self.cfg.nats_creds, tls_ca=self.cfg.nats_ca, node=self.host.node,
                                     allow_plaintext_password=self.cfg.nats_insecure_plaintext)
            except (OSError, ValueError) as err:     # credentials unreadable or malformed, a password in clear
                raise BadInput(f"nats: {err}") from None
            self.nats.serve(control_subject(self.host.node), self.remote)   # the controller's cluster-wide traces
        self.prom = None
        if self.cfg.prometheus:
            from jobprobe.exporters.prometheus import PromSink, owner_names
            from jobprobe.node.probe import schema_of
            from jobprobe.node.registry import all_probes
            # every probe's declarations, meanings included: HELP lines, and the fields of a probe switched on
            # for a job while it runs (its hello named only the probes it started with)
            self.prom = PromSink(self.cfg.prometheus, self.cfg.prometheus_max_jobs,
                                 owner_names(self.cfg.prometheus_labels),
                                 declared=schema_of(all_probes().values(), docs=True))

    def _file_of(self, job: str) -> dict[str, str]:
        """{"file": the job's frame file} where the agent writes one (--out) and it exists; else {}."""
        try:
            path = job_path(self.cfg.out, job) if self.cfg.out else ""
        except ValueError:
            return {}
        return {"file": path} if path and os.path.exists(path) else {}

    def _default_sinks(self, job: str) -> list:
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

    def _heartbeat(self, stopping: bool = False, jobs: int | None = None) -> None:
        """The node's liveness to every controller, with or without jobs (a job's frames reach only its own
        partition's controller): a heartbeat frame each tick, saying how many jobs are attached; `stopping`, once,
        at a clean stop (then no more)."""
        with self.lock:
            if self.beat is None:
                return
            n = len(self.jobs) if jobs is None else jobs
            beat = self.beat.heartbeat(time.time(), self.cfg.interval, n, stopping)
            if stopping:
                self.beat = None
        try:
            self.nats.heartbeat(beat)
        except Exception as err:     # the spool's disk: the next tick tries again
            log.warning("heartbeat: %s: %s", type(err).__name__, err)
