# SPDX-License-Identifier: Apache-2.0
"""A kubelet (or API server) for the tests: Kubelet serves a PodList the test sets, over HTTP or TLS; pods made as
the real PodList shapes them (pod, pod_list), pod a laid out and listed (pod_a_listed), a self-signed certificate
(self_signed). Used by test_k8s_watch and test_image."""
from __future__ import annotations

import json
import os
import ssl
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOKEN = "s3cr3t-service-account-token"
ON = {"jobprobe.io/probe": "true"}
UIDS = {name: str(uuid.uuid4()) for name in "abcd"}   # fresh each run: no other group on the node has them


def pod(name: str, annotations: dict | None = None, phase: str = "Running", containers=("main",),
        started: str | None = None) -> dict:
    return {"metadata": {"name": name, "namespace": "train", "uid": UIDS[name], "annotations": annotations or {}},
            "spec": {"nodeName": "node-1", "containers": [{"name": c, "image": "x"} for c in containers]},
            "status": {"phase": phase, "startTime": started or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}


def pod_list(*pods: dict) -> dict:
    return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list(pods)}


class Kubelet:
    """GET /pods (or the API server's /api/v1/pods) → whatever `answer` says: a dict (JSON), bytes (sent as they
    are), or an int (that HTTP status). Over TLS with `tls=(cert, key)`. `seen`: each request's path and
    Authorization header, as the server received them."""

    def __init__(self, tls: tuple[Path, Path] | None = None):
        self.answer: object = pod_list()
        self.port = 0
        self.tls = tls
        self.seen: list[tuple[str, str | None]] = []
        self.start()

    def start(self):
        kubelet = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                kubelet.seen.append((self.path, self.headers.get("Authorization")))
                a = kubelet.answer
                if isinstance(a, int):
                    self.send_error(a)
                    return
                body = a if isinstance(a, bytes) else json.dumps(a).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)   # the same port when it comes back
        self.port = self.server.server_address[1]
        scheme = "http"
        if self.tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*map(str, self.tls))
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def pod_a_listed(root: Path, cert: Path, key: Path) -> tuple[Path, subprocess.Popen, Kubelet]:
    """Pod a's container group under ROOT, laid out as the kubelet's systemd driver does, with a process in it; and
    an API server over TLS (CERT, KEY) that lists pod a, annotated to be probed."""
    group = root / "kubepods.slice/kubepods-burstable.slice" / \
        f"kubepods-burstable-pod{UIDS['a'].replace('-', '_')}.slice" / "cri-containerd-aaaa.scope"
    group.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "600"], preexec_fn=lambda: (group / "cgroup.procs").write_text(
        str(os.getpid())))
    api = Kubelet(tls=(cert, key))
    api.answer = pod_list(pod("a", ON))
    return group, sleeper, api


def self_signed(d: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key: the peer's certificate and its CA at once."""
    d.mkdir(parents=True)
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key
