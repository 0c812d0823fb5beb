# SPDX-License-Identifier: Apache-2.0
"""The node agent's settings: Config, read from its TOML file (DEFAULT_CONFIG, /etc/jobprobe/agent.toml) with every
key also a flag of `jobprobe agent` (flags win).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from jobprobe.core import tomlfile
from jobprobe.core.errors import BadInput

DEFAULT_CONFIG = "/etc/jobprobe/agent.toml"


@dataclass
class Config:
    """The agent's settings: /etc/jobprobe/agent.toml, every key also a flag (flags win)."""
    interval: float = 1.0
    probes: str | None = None           # the default --probes spec of attached jobs
    out: str | None = None              # a directory: each job's frames to OUT/<job>.mpk
    out_max_mb: float | None = None
    stdout: str | None = None           # "human" | "json": every job's frames on stdout too
    socket: str = "/run/jobprobe/agent.sock"
    state: str = "/run/jobprobe/jobs.json"
    attach_wait: float = 30.0           # s to wait for a job's processes to appear (the prolog case)
    queue: int = 1024                   # frames each sink may hold before it drops the oldest
    slurm: bool = False                 # a SLURM node: at start, attach the running jobs the prolog could not
    slurm_node: str | None = None       # this node's SLURM name (default: the short host name)
    k8s: str | None = None              # the kubelet's URL (https://<node>:10250): probe the pods annotated for it
    k8s_every: float = 5.0              # s between two looks at the kubelet's pod list
    k8s_token_file: str | None = None   # a bearer token for the kubelet (the service account's)
    k8s_ca: str | None = None           # the CA that signed the kubelet's certificate
    k8s_insecure: bool = False          # do not check the peer's certificate (refused with a token)
    k8s_node: str | None = None         # this node's Kubernetes name: its pods from the API server's list
    k8s_labels: str = ""                # pod labels (keys, comma-separated) copied into each pod's job labels
    nats: str | None = None             # nats://HOST:PORT[,…]: every job's frames to the controller's JetStream
    spool: str = "/var/lib/jobprobe/spool"   # frames waiting for the NATS server's ack, on disk
    spool_max_mb: float = 256.0         # past this the oldest unacked frames go (counted, logged)
    nats_creds: str | None = None       # this node's NATS credentials: .creds (JWT + nkey), .nk seed, or user:password
    nats_ca: str | None = None          # TLS: the CA of the NATS servers' certificates
    nats_insecure_plaintext: bool = False   # allow a password or token in clear to a server that is not loopback
    node: str | None = None             # this node's name in frames (default: the short host name)
    prometheus: str | None = None       # HOST:PORT: serve every job's metrics at /metrics
    rules: str | None = None            # a rules file, or "default": `rule` events over each job's frames
    trace_dir: str = "/var/lib/jobprobe/traces"   # deep-trace windows' files (rules' `trace` action, `trace`)
    trace_every: float | None = None    # a deep-trace window every S s of each job's run (as a request)
    prometheus_max_jobs: int = 256      # jobs exposed at most (the rest counted: bounded cardinality)
    prometheus_labels: str = "user,account,partition,qos,namespace"   # a job's labels on each of its series

    @classmethod
    def load(cls, path: str | None, overrides: dict[str, Any]) -> Config:
        data: dict[str, Any] = {}
        if path and (path != DEFAULT_CONFIG or os.path.exists(path)):    # the default one may be absent
            _, data = tomlfile.read(path, "config")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise BadInput(f"config {path}: unknown key {sorted(unknown)[0]!r}; known: "
                           f"{', '.join(cls.__dataclass_fields__)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        for key, value in data.items():
            want = str(cls.__dataclass_fields__[key].type)
            if not _of_type(value, want):
                raise BadInput(f"config {path}: {key} = {repr(value)[:60]}: expected {want.replace(' | None', '')}")
        cfg = cls(**data)
        if cfg.interval <= 0:
            raise BadInput(f"interval must be positive, got {cfg.interval}")
        return cfg


def _of_type(value: Any, annotation: str) -> bool:
    """Whether a setting's value is of its declared type ("float", "str | None", …): an int is a float, a bool is
    neither, a float is finite."""
    kinds = {k.strip() for k in annotation.split("|")} - {"None"}
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, int):
        return bool(kinds & {"int", "float"})
    if isinstance(value, float):
        return "float" in kinds and math.isfinite(value)
    return isinstance(value, str) and "str" in kinds
