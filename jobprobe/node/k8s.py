# SPDX-License-Identifier: Apache-2.0
"""Kubernetes: the agent's `--k8s URL` mode. A thread asks for this node's pods every few seconds, attaches every pod
annotated `jobprobe.io/probe: "true"` (probes from `jobprobe.io/probes`, else the agent's default) and detaches it when
it leaves the list, ends, or loses the annotation. Frames carry the pod's namespace, name, UID and containers as labels.

Where the list comes from, least privilege first:
- the API server (`--k8s https://kubernetes.default.svc --k8s-node NODE`): GET /api/v1/pods with the field selector
  `spec.nodeName=NODE`, which RBAC authorizes as `list pods` and nothing more, on every Kubernetes version. It is
  served from the API server's watch cache (resourceVersion=0), not from etcd. The manifest uses this.
- the node's kubelet (`--k8s https://NODE:10250`): GET /pods. Kubelets before fine-grained authorization (KEP-2862,
  beta in 1.33) authorize that as `nodes/proxy`, which also allows exec into every container of the node: kept for
  clusters that want no API server traffic, not for the manifest.

The peer's certificate is verified (`--k8s-ca`, else the service account's ca.crt in a pod, else the system's
CAs); a bearer token is never sent to a peer that is not verified, nor in clear: `--k8s-insecure` with a token, or a
token to an http:// URL, is refused before anything starts.

The peer may be slow, down or confused: a failed or garbled answer is logged (once per kind of failure, and again
when it recovers), tried again with a backoff up to a minute, and changes nothing — attached pods keep being probed,
and a pod is detached only on an answer that parses and no longer lists it. A probe name in the annotation that no
probe has is refused; the pod is attached with the others, and `jobprobe status` says which was refused.

Sits above the agent (it drives it, as the SLURM prolog does): of the node it imports only the Agent and JobSpec.
"""
from __future__ import annotations

import json
import logging
import os
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobprobe.core.errors import BadInput
from jobprobe.core.retry import Backoff
from jobprobe.node.agent import Agent
from jobprobe.node.jobspec import JobSpec

log = logging.getLogger("jobprobe.node.k8s")

ANNOTATION = "jobprobe.io/probe"
PROBES_ANNOTATION = "jobprobe.io/probes"
TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
MAX_BACKOFF_S = 60.0
FRESH_S = 30.0       # a pod that started less than this ago is attached from its start


@dataclass
class Pod:
    uid: str
    namespace: str
    name: str
    containers: list[str]
    probes: str | None          # the annotation's spec, as given
    started: float | None = None   # status.startTime, UNIX s
    owner: str = ""             # its controller (ownerReferences): `Job/train-7`, `StatefulSet/ddp`
    extra: dict[str, str] | None = None   # its labels the operator allow-listed (--k8s-labels), names made safe

    @property
    def job(self) -> str:
        return f"{self.namespace}/{self.name}"

    def labels(self) -> dict[str, str]:
        return {**(self.extra or {}), "namespace": self.namespace, "pod": self.name, "pod_uid": self.uid,
                "containers": ",".join(self.containers), **({"owner": self.owner} if self.owner else {})}


MAX_LABEL = 128        # characters of a pod label's value copied into the job's labels


def label_name(key: str) -> str:
    """A pod label's key as a job label's name: `app.kubernetes.io/name` → `app_kubernetes_io_name`."""
    return re.sub(r"[^A-Za-z0-9_]", "_", key)


def owner_of(meta: dict) -> str:
    """`Kind/name` of the pod's controlling owner (ownerReferences, the one with controller: true, else the
    first); "" without one. What chargeback groups pods by: the Job, the StatefulSet."""
    refs = meta.get("ownerReferences")
    if not isinstance(refs, list):
        return ""
    refs = [r for r in refs
            if isinstance(r, dict) and isinstance(r.get("kind"), str) and isinstance(r.get("name"), str)]
    ref = next((r for r in refs if r.get("controller") is True), refs[0] if refs else None)
    return f"{ref['kind']}/{ref['name']}"[:MAX_LABEL] if ref else ""


# a pod's own words for why it ended (status.reason, a DisruptionTarget condition's reason) → its end's cause
POD_CAUSES = {"DeadlineExceeded": "timeout", "Evicted": "evicted", "PreemptionByScheduler": "preempted",
              "PreemptionByKubeScheduler": "preempted", "EvictionByEvictionAPI": "evicted",
              "DeletionByTaintManager": "evicted", "TerminationByKubelet": "evicted", "OOMKilled": "oom_kill"}


def pod_end(status: dict) -> dict[str, Any]:
    """How an ended pod ended, from its status as the kubelet wrote it: {"status": {"exit_code": n} or
    {"signal": n}, "cause": …, "scheduler": its words} (core/ends.record's scheduler). The lead container is the
    first that ended badly, else the last listed; a runtime's 128 + N is death by signal N. A field of another
    shape than the kubelet's is left out, never raised: the pod has ended, the rest of the list still counts."""
    def listed(key: str) -> list:
        v = status.get(key)
        return v if isinstance(v, list) else []
    terminated = []
    for c in listed("containerStatuses"):
        term = c.get("state", {}).get("terminated") if isinstance(c, dict) and isinstance(c.get("state"), dict) \
            else None
        if isinstance(term, dict) and isinstance(term.get("exitCode"), int) and 0 <= term["exitCode"] <= 255:
            terminated.append((str(c.get("name", "?"))[:60], term["exitCode"], str(term.get("reason", ""))[:40]))
    lead = next((t for t in terminated if t[1] != 0), terminated[-1] if terminated else None)
    reasons = [status.get("reason")] + [c.get("reason") for c in listed("conditions")
                                        if isinstance(c, dict) and c.get("type") == "DisruptionTarget" and
                                        c.get("status") == "True"] + [lead[2] if lead else None]
    cause = next((POD_CAUSES[r] for r in reasons if isinstance(r, str) and r in POD_CAUSES), None)
    words = "/".join(str(w)[:40] for w in [status.get("phase")] + [r for r in reasons if isinstance(r, str) and r])
    out: dict[str, Any] = {"status": {}, "scheduler": (words + (f" (container {lead[0]})" if lead else ""))}
    if lead is not None:
        out["status"] = {"signal": lead[1] - 128} if 128 < lead[1] < 160 else {"exit_code": lead[1]}
    if cause:
        out["cause"] = cause
    return out


def wanted_pods(doc: Any, allow: tuple[str, ...] = (), ended: dict[str, dict] | None = None) -> dict[str, Pod]:
    """The pods of a pod list (a v1 PodList: the kubelet's /pods or the API server's /api/v1/pods) that ask to be
    probed and have not ended, by UID. ValueError when the document is not a pod list — a pod without a name and a
    UID, or a field of another type than a pod list gives it, included: the peer is trusted to send pod lists, not
    to send good ones. `allow`: the pod labels (keys) copied into the job's labels; `ended`: filled with the ended
    pods' ends (pod_end) by UID."""
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ValueError("not a pod list (no items)")
    out = {}
    for item in doc["items"]:
        meta = _table(item, "a pod").get("metadata")
        if not isinstance(meta, dict) or not meta.get("uid") or not meta.get("name"):
            raise ValueError("a pod without metadata.uid or metadata.name")
        uid, name, namespace = meta["uid"], meta["name"], meta.get("namespace", "default")
        if not all(isinstance(v, str) for v in (uid, name, namespace)):
            raise ValueError("a pod whose uid, name or namespace is not a string")
        ann = _table(meta.get("annotations"), "metadata.annotations")
        if str(ann.get(ANNOTATION, "")).strip().lower() not in ("true", "yes", "1"):
            continue
        status = _table(item.get("status"), "status")
        if status.get("phase") in ("Succeeded", "Failed"):
            if ended is not None:
                ended[uid] = pod_end(status)
            continue
        listed = _table(item.get("spec"), "spec").get("containers") or []
        if not isinstance(listed, list):
            raise ValueError("spec.containers is not a list")
        containers = [str(_table(c, "a container").get("name", "?")) for c in listed]
        probes = ann.get(PROBES_ANNOTATION)
        labels = _table(meta.get("labels"), "metadata.labels")
        extra = {label_name(k): str(labels[k])[:MAX_LABEL] for k in allow if isinstance(labels.get(k), str)}
        out[uid] = Pod(uid, namespace, name, containers, None if probes is None else str(probes),
                       start_time(status.get("startTime")), owner_of(meta), extra)
    return out


def _table(v: Any, what: str) -> dict:
    """A pod list's object field: {} where absent; ValueError where it is not an object."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError(f"{what} is not an object")
    return v


def start_time(text: Any) -> float | None:
    """RFC 3339 (`2026-12-01T10:00:00Z`) → UNIX s; None if absent or unreadable."""
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp() if text else None
    except (ValueError, OverflowError, OSError):
        return None


def split_probes(spec: str | None, known: set[str]) -> tuple[str | None, list[str]]:
    """(the spec with only probes that exist, the names refused). `+x,-y` edits and plain names alike."""
    if spec is None or not spec.strip():
        return None, []
    keep, refused = [], []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        name = item.lstrip("+-")
        (keep if name in known or name in ("all", "std", "standard") else refused).append(item)
    return (",".join(keep) if keep else None), refused


def tls_context(url: str, ca_file: str | None = None, insecure: bool = False,
                token_file: str | None = None) -> ssl.SSLContext | None:
    """The TLS context for the peer at `url` (None for http://). The peer's certificate is checked against `ca_file`,
    else the service account's ca.crt where it exists (the cluster CA, in a pod), else the system's CAs.
    BadInput where a bearer token would go to a peer that is not verified or in clear: the token lets whoever
    holds it act as the agent's service account, so it goes only where the peer has proven who it is."""
    https = url.startswith("https:")
    if not https and not url.startswith("http:"):
        raise BadInput(f"--k8s {url}: not an http(s):// URL")
    if token_file and not https:
        raise BadInput(f"--k8s {url}: a token is never sent in clear; give an https:// URL")
    if token_file and insecure:
        raise BadInput("--k8s-insecure with --k8s-token-file: a token is never sent to an unverified peer; "
                       f"give the cluster CA with --k8s-ca FILE (in a pod: {CA})")
    if not https:
        return None
    if insecure:
        return ssl._create_unverified_context()
    cafile = ca_file or (CA if os.path.exists(CA) else None)
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as err:
        raise BadInput(f"--k8s-ca {cafile}: {err}") from None


def pods_path(node: str | None) -> str:
    """The request for this node's pods: the API server's pod list narrowed to the node (RBAC: `list pods`, served
    from its watch cache), or, without a node name, the kubelet's own list."""
    if node is None:
        return "/pods"
    if not node.strip():
        raise BadInput("--k8s-node: empty (in a pod: the downward API's spec.nodeName)")
    return "/api/v1/pods?" + urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}",
                                                     "resourceVersion": "0"})


class PodWatcher:
    def __init__(self, agent: Agent, url: str, every: float = 5.0, token_file: str | None = None,
                 ca_file: str | None = None, insecure: bool = False, timeout: float = 5.0, node: str | None = None,
                 labels: tuple[str, ...] = ()):
        self.agent, self.url, self.every, self.timeout = agent, url.rstrip("/"), every, timeout
        self.labels = labels         # the pod labels copied into each job's (--k8s-labels)
        self.token_file = token_file
        self.context = tls_context(self.url, ca_file, insecure, token_file)
        self.path = pods_path(node)
        self.peer = "kubelet" if node is None else "API server"
        self.attached: dict[str, str] = {}      # pod UID → the job's name in the agent
        self.ended: dict[str, dict] = {}        # the last list's ended pods: UID → how (pod_end)
        self.failing: str | None = None         # the kind of failure logged last (logged again when it changes)
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    # ---- one look at the pod list -----------------------------------------------------------------------
    def fetch(self) -> dict[str, Pod]:
        req = urllib.request.Request(self.url + self.path, headers={"Accept": "application/json"})
        if self.token_file:     # read each time: projected service account tokens are rotated
            with open(self.token_file) as f:
                req.add_header("Authorization", f"Bearer {f.read().strip()}")
        ended: dict[str, dict] = {}
        with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as resp:
            pods = wanted_pods(json.loads(resp.read(64 << 20)), self.labels, ended)
        self.ended = ended
        return pods

    def poll(self) -> None:
        """Attach the pods that ask for it, detach those that no longer do. Raises what fetch() raises."""
        pods = self.fetch()
        if self.failing:      # said before anything is done with its answer
            log.warning("%s at %s answers again", self.peer, self.url)
            self.failing = None
        known = set(self.agent.registry)
        for uid, pod in pods.items():
            if uid in self.attached:
                continue
            probes, refused = split_probes(pod.probes, known)
            note = f"refused probes {', '.join(refused)}: no such probe" if refused else None
            if refused:
                log.warning("pod %s asks for %s: no such probe; attached with the others", pod.job,
                            ", ".join(refused))
            # A pod seen as it starts counts from its start (as a SLURM job from its prolog); one found long
            # running (the agent came up after it) counts from now.
            fresh = pod.started is not None and time.time() - pod.started < max(FRESH_S, 3 * self.every)
            spec = JobSpec(k8s_pod=uid, job=pod.job, probes=probes, labels=pod.labels(), note=note,
                           from_start=fresh)
            try:
                r = self.agent.attach(spec, defer=True)
            except BadInput as err:
                log.warning("pod %s not attached: %s", pod.job, err)
                continue
            self.attached[uid] = r["job"]
            log.info("pod %s: %s", pod.job, r["state"])
        for uid in [u for u in self.attached if u not in pods]:
            name = self.attached.pop(uid)
            end = self.ended.get(uid)
            why = f"the pod ended: {end['scheduler']}" if end else \
                f"the pod left the {self.peer}'s list (deleted, or no annotation)"
            try:
                self.agent.detach(name, why=why, told=end)
            except BadInput:
                pass                            # it had already ended by itself

    # ---- the thread --------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="k8s", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # after a failure, a jittered backoff from one poll interval up to MAX_BACKOFF_S: the agents of every node
        # that lost the API server at the same moment do not all ask again at the same moments
        backoff = Backoff(initial=self.every, maximum=max(self.every, MAX_BACKOFF_S))
        while not self.stop_event.is_set():
            try:
                self.poll()
                wait = self.every
                backoff.reset()
            except (OSError, ValueError, urllib.error.URLError) as err:   # down, refused, garbage: try again later
                kind = type(err).__name__
                if kind != self.failing:
                    log.warning("%s at %s: %s: %s; attached pods go on; trying again with backoff", self.peer,
                                self.url, kind, err)
                self.failing, wait = kind, backoff.next()
            except Exception:   # a bug must not stop the watching
                log.exception("k8s watcher")
                wait = backoff.next()
            self.stop_event.wait(wait)

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=self.timeout + 1)
