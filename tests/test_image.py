# SPDX-License-Identifier: Apache-2.0
"""The DaemonSet's image, as it runs: its root filesystem built from the Containerfile's own steps
(tests/image_build.py: Debian bookworm, then each COPY and RUN in a chroot), the wheels from `make wheels`. Then the
agent is started in it the way the DaemonSet starts it — the manifest's command and arguments, the host's /sys, /proc
(hostPID), /dev, /lib/modules, /usr/src, /run/jobprobe and /var/lib/jobprobe mounted where the manifest mounts them,
the service account's token and CA where Kubernetes puts them — against an API server served by the test that lists
a pod running on the host: the pod is attached, and its frames' CPU equals the pod group's cpu.stat. The image holds
the agent's packages and nothing of the test or demo stack."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from builds import AGENT_DISTS, dists, make
from conftest import until, workload
from image_build import build, digest
from jobprobe.core.frame import StreamReader
from jobprobe.exporters.file import job_path
from kubefake import TOKEN, pod_a_listed, pod_list, self_signed

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.kernel, pytest.mark.integration,
              pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="no mmdebstrap (scripts/setup.sh)")]
SA = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """(root filesystem, entrypoint): the Containerfile's steps over the wheels `make wheels` made of this checkout."""
    base = tmp_path_factory.mktemp("image")
    dist = base / "dist"
    make("wheels", dist, tmp_path_factory)
    context = base / "context"              # the build context: the checkout, with that dist/ in it
    (context / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts/image-install.sh", context / "scripts")
    shutil.copytree(dist, context / "dist")
    root = base / "root"
    root.mkdir()
    entry = build(REPO / "Containerfile", context, root)
    yield root, entry
    subprocess.run(["rm", "-rf", "--one-file-system", str(root)], timeout=300)


def test_the_cached_layers_key_is_the_contexts_files_not_where_the_context_is(tmp_path):
    """The steps before the wheel are cached per machine under a key of what they read: the same files in two
    build contexts (each test run builds its own in a fresh temporary directory) give one key, a byte or a name
    changed another (the key once held the context's path: no run ever found the last one's layers)."""
    def context(at: Path, name: str = "image-install.sh", body: bytes = b"#!/bin/sh\n") -> list[Path]:
        (at / "scripts").mkdir(parents=True)
        (at / "scripts" / name).write_bytes(body)
        return [at / "scripts" / name]
    key = digest(context(tmp_path / "a"), tmp_path / "a")
    assert digest(context(tmp_path / "b"), tmp_path / "b") == key
    assert digest(context(tmp_path / "c", body=b"#!/bin/sh \n"), tmp_path / "c") != key
    assert digest(context(tmp_path / "d", name="install.sh"), tmp_path / "d") != key


def image_stubs(root: Path) -> Path:
    """The stub libraries `make wheels` built for this image (beside its root filesystem)."""
    return root.parent / "dist" / "wheels" / "stubs"


def in_image(root: Path, *argv: str) -> str:
    return subprocess.run(["chroot", str(root), "/usr/bin/env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", *argv],
                          check=True, capture_output=True, text=True, timeout=120).stdout


def test_the_image_holds_the_agent_and_nothing_of_the_test_stack(image):
    root, entry = image
    assert entry == ["/opt/jobprobe/bin/jobprobe", "agent"]
    held = dists(["chroot", str(root), "/opt/jobprobe/bin/python"])
    assert held == AGENT_DISTS, held          # no pip, setuptools, pytest, torch, nats-py, matplotlib …
    packages = set(in_image(root, "dpkg-query", "-W", "-f", "${Package}\n").split())
    assert "python3-bpfcc" in packages and not packages & {"python3-venv", "python3-pip", "perl", "usrmerge", "apt",
                                                           "perl-base", "libgnutls30"}
    lib = root / "usr/lib/x86_64-linux-gnu"    # the stubs bcc never calls (scripts/image-stubs), not Debian's files:
    for f in ("libz3.so.4", "libicudata.so.72"):   # the agent below compiles its programs with them in place
        assert (lib / f).resolve().read_bytes() == (image_stubs(root) / f).read_bytes(), f
    assert in_image(root, "jobprobe", "--version").startswith("jobprobe ")
    assert not list((root / "usr/share/doc").glob("*/*")), "docs are kept out of the image"
    size = int(subprocess.run(["du", "-sb", str(root)], capture_output=True, text=True).stdout.split()[0])
    bcc = sum(int(subprocess.run(["du", "-sb", *map(str, root.glob(g))], capture_output=True, text=True)
                  .stdout.split()[0] or 0) for g in ("usr/lib/x86_64-linux-gnu/libLLVM-14.so.1", "usr/lib/llvm-14"))
    print(f"image root filesystem: {size / 1e6:.0f} MB, of which LLVM/clang (bcc's compiler) {bcc / 1e6:.0f} MB")
    assert size <= 300e6, f"the image is {size / 1e6:.0f} MB: over its 300 MB target (docs/DEPLOY.md)"


def inside(root: Path, path: str) -> Path:
    """PATH as the image sees it, on this host: links in the image (/var/run → /run) resolved within ROOT, never
    out of it onto the host's own directories."""
    out = root
    for part in Path(path).parts[1:]:
        nxt = out / part
        for _ in range(40):
            if not nxt.is_symlink():
                break
            target = os.readlink(nxt)
            nxt = (root / target.lstrip("/")) if target.startswith("/") else (nxt.parent / target)
        out = nxt
    assert out == root or root in out.parents, (path, out)
    return out


def daemonset_argv(node: str, api: str) -> list[str]:
    """The agent container's command and arguments from scripts/k8s/jobprobe.yaml, $(NODE_NAME) and the API server's
    address filled in as the kubelet would (the address: the test's stand-in)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML (the test extra) is not installed")
    ds = next(d for d in yaml.safe_load_all((REPO / "scripts/k8s/jobprobe.yaml").read_text())
              if d["kind"] == "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(NODE_NAME)", node) for a in c["args"]]
    args = [f"--k8s={api}" if a.startswith("--k8s=") else a for a in args]
    return c["command"] + args + ["--k8s-every", "0.5"]


def test_the_agent_in_the_image_probes_a_pod_on_the_host(image, make_cgroup, tmp_path):
    root, _ = image
    cert, key = self_signed(tmp_path / "tls")
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(TOKEN)
    shutil.copy(cert, sa / "ca.crt")
    run, frames_dir = tmp_path / "run", tmp_path / "var-lib"
    run.mkdir()
    frames_dir.mkdir()
    group, sleeper, api = pod_a_listed(make_cgroup().path, cert, key)
    mounts = {"/sys": "/sys", "/proc": "/proc", "/dev": "/dev", "/lib/modules": "/lib/modules",
              "/usr/src": "/usr/src", str(run): "/run/jobprobe", str(frames_dir): "/var/lib/jobprobe", str(sa): SA}
    # the root filesystem a mount of its own first, as a container runtime makes it (its / is a mount point: the
    # BPF loader makes / private in its own mount namespace before it mounts its bpffs)
    script = f"mount --bind {root} {root} && " + " && ".join(
        f"mkdir -p {inside(root, dst)} && mount --rbind {shlex.quote(src)} {inside(root, dst)}"
        for src, dst in mounts.items())
    argv = daemonset_argv("node-1", api.url)
    agent = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{script} && exec chroot "
                              f"{root} /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin {shlex.join(argv)}"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "agent.log", "w"))
    from jobprobe.node.control import call
    burner = None

    def jobs() -> set[str]:
        try:
            return {j["job"] for j in call(str(run / "agent.sock"), {"cmd": "status"})["jobs"]}
        except Exception:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
            return set()

    def frames() -> list[dict]:
        path = Path(job_path(str(frames_dir / "frames"), "train/a"))
        with open(path, "rb") if path.exists() else open(os.devnull, "rb") as f:
            return list(StreamReader(f))

    try:
        until(lambda: "train/a" in jobs(), 120, "the pod to be attached by the agent in the image")
        until(lambda: any(f["kind"] == "sample" for f in frames()), 60, "the pod's first frame")
        burner = subprocess.Popen(workload("burncpu", 0.5), preexec_fn=lambda: (group / "cgroup.procs").write_text(
            str(os.getpid())))
        assert burner.wait(timeout=60) == 0
        api.answer = pod_list()
        until(lambda: "train/a" not in jobs(), 60, "the pod to be let go (a last frame)")
        usage_ns = int(dict(ln.split() for ln in (group.parent / "cpu.stat").read_text().splitlines())
                       ["usage_usec"]) * 1000
        fa = frames()
        assert fa[0]["kind"] == "hello" and fa[0]["from_start"] is True, fa[0]
        samples = [f for f in fa if f["kind"] == "sample"]
        cpu = sum(f["probes"]["cgroup"]["cpu_user_ns"] + f["probes"]["cgroup"]["cpu_system_ns"] for f in samples)
        print(f"pod a: frames {cpu / 1e6:.0f} ms CPU, its group's cpu.stat {usage_ns / 1e6:.0f} ms; "
              f"probes in its frames: {sorted(samples[-1]['probes'])}")
        assert usage_ns > 0.4e9 and abs(cpu - usage_ns) <= 0.02 * usage_ns + 1e6, (cpu, usage_ns)
        assert {"sched", "net", "blockio"} <= set(samples[-1]["probes"]), fa[0]["probes"]   # BPF compiled in the image
        assert {p for p, _ in api.seen} and all(auth == f"Bearer {TOKEN}" for _, auth in api.seen)
    finally:
        api.stop()
        if burner is not None and burner.poll() is None:
            burner.kill()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        sleeper.kill()
        sleeper.wait()
        print((tmp_path / "agent.log").read_text()[-2000:], file=sys.stderr)
