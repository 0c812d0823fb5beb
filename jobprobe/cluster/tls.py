# SPDX-License-Identifier: Apache-2.0
"""`jobprobe controller tls HOST…`: the certificates the controller's nats-server needs off loopback, in one command
(openssl, which every host of this kind has): a CA of the cluster's own (kept: made once, reused), and a server
certificate signed by it for the names and addresses agents will dial. Agents need only the CA's certificate
(`--nats-ca`); nothing of this leaves the controller but that file.

DATA/tls/: ca.pem (give it to every agent), ca.key (0600, stays here), server.pem, server.key (0600). Run again
with other names: a new server certificate from the same CA — agents keep theirs.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from pathlib import Path

from jobprobe.core.errors import BadInput

CA_DAYS = 3650
SERVER_DAYS = 825          # what browsers' and most clients' limits allow a server certificate
DNS = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?")


def subject_alt_names(hosts: list[str]) -> str:
    """`IP:…,DNS:…` for openssl; BadInput for a name that is neither an address nor a DNS name (a comma, a newline,
    a slash: nothing that could write another line into openssl's config)."""
    if not hosts:
        raise BadInput("controller tls: give the names or addresses agents dial (e.g. ctl.example.org 10.0.0.5)")
    out = []
    for h in hosts:
        try:
            out.append(f"IP:{ipaddress.ip_address(h)}")
        except ValueError:
            if not DNS.fullmatch(h):
                raise BadInput(f"controller tls: {h[:80]!r} is neither an IP address nor a DNS name") from None
            out.append(f"DNS:{h.rstrip('.')}")
    return ",".join(dict.fromkeys(out))


def _ssl(*args: str, cwd: Path) -> None:
    try:
        res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    except OSError as err:
        raise BadInput(f"controller tls: cannot run openssl: {err.strerror}") from None
    if res.returncode != 0:
        raise BadInput(f"controller tls: openssl {args[0]} failed: {res.stderr.strip().splitlines()[-1][:200]}")


def make(data: str, hosts: list[str]) -> dict[str, str]:
    """The CA (made if absent) and a server certificate for `hosts` under DATA/tls; {name: path}."""
    if shutil.which("openssl") is None:
        raise BadInput("controller tls: openssl is not installed (apt install openssl)")
    san = subject_alt_names(hosts)
    d = Path(data, "tls")
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    if d.is_symlink() or not d.is_dir():
        raise BadInput(f"controller tls: {d} is not a directory of its own")
    os.chmod(d, 0o700)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    old = os.umask(0o077)          # keys are born 0600
    try:
        if not (d / "ca.pem").exists() or not (d / "ca.key").exists():
            _ssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", str(CA_DAYS), "-subj",
                 "/CN=jobprobe cluster CA", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
        (d / "server.ext").write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
                                      "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
        _ssl("req", *ec, "-keyout", "server.key.new", "-out", "server.csr", "-subj", f"/CN={hosts[0]}", cwd=d)
        _ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem.new", "-days", str(SERVER_DAYS), "-extfile", "server.ext", cwd=d)
        os.replace(d / "server.key.new", d / "server.key")
        os.replace(d / "server.pem.new", d / "server.pem")
    finally:
        os.umask(old)
        for f in ("server.csr", "server.ext", "server.key.new", "server.pem.new"):
            (d / f).unlink(missing_ok=True)
    return {n: str(d / f) for n, f in (("ca", "ca.pem"), ("cert", "server.pem"), ("key", "server.key"))}
