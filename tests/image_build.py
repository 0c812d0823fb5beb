# SPDX-License-Identifier: Apache-2.0
"""The Containerfile's image built where no container runtime runs (this machine refuses them): FROM debian:SUITE-slim
becomes a root filesystem from the same Debian release (`mmdebstrap --variant=minbase`, merged /usr, the slim
image's dpkg excludes), then each COPY and RUN step is applied in order — RUN in a chroot with /proc, /dev and the
host's resolv.conf, in a mount namespace of its own, with the image builders' default PATH and an empty environment.
The steps before the first one that copies from dist/ (the wheel) are cached per machine, keyed by everything they
read (the FROM line, the steps' text, the files they copy), as an image builder caches its layers."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CACHE = Path("/var/cache/jobprobe-tests")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SLIM = ["doc", "man", "info", "locale", "groff", "lintian"]      # the slim images' /etc/dpkg/dpkg.cfg.d/docker


@dataclass
class Step:
    op: str                 # FROM, COPY, RUN, ENTRYPOINT, CMD
    arg: str


def steps(containerfile: Path) -> list[Step]:
    out = []
    for line in containerfile.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, arg = line.partition(" ")
            if op not in ("FROM", "COPY", "RUN", "ENTRYPOINT", "CMD"):
                raise ValueError(f"{containerfile}: {op} is not a step this builder knows")
            out.append(Step(op, arg.strip()))
    return out


def digest(files: list[Path], context: Path) -> str:
    """The files' names in the build context and their bytes (not where the context is: the tests build theirs in
    a fresh temporary directory each run, and a key with its path in it never matched)."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f.relative_to(context)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def sources(step: Step, context: Path) -> list[Path]:
    *src, _ = shlex.split(step.arg)
    return [p for s in src for p in ((context / s).rglob("*") if (context / s).is_dir() else [context / s])
            if p.is_file()]


def bootstrap(image: str, root: Path) -> None:
    repo, _, tag = image.partition(":")
    if repo != "debian" or not tag.endswith("-slim"):
        raise ValueError(f"FROM {image}: only debian:SUITE-slim is built here")
    subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
                    *[f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in SLIM], tag.removesuffix("-slim"),
                    str(root)], check=True, timeout=900)


def run_in(root: Path, command: str) -> None:
    """RUN: `sh -c COMMAND` in the root filesystem, as an image builder runs it."""
    resolv = root / "etc/resolv.conf"
    script = (f"mount -t proc proc {root}/proc && mount --rbind /dev {root}/dev && "
              f"exec chroot {root} /usr/bin/env -i PATH={PATH} HOME=/root /bin/sh -c {shlex.quote(command)}")
    had = resolv.exists() or resolv.is_symlink()
    if not had:
        shutil.copyfile("/etc/resolv.conf", resolv)
    try:
        subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], check=True,
                       timeout=900)
    finally:
        if not had:
            resolv.unlink()


def copy_in(step: Step, context: Path, root: Path) -> None:
    *src, dst = shlex.split(step.arg)
    for s in src:
        s_path, d_path = context / s, root / dst.lstrip("/")
        if s_path.is_dir():
            shutil.copytree(s_path, d_path, dirs_exist_ok=True)
        else:
            if dst.endswith("/"):
                d_path = d_path / s_path.name
            d_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s_path, d_path)


def apply(step: Step, context: Path, root: Path) -> None:
    if step.op == "COPY":
        copy_in(step, context, root)
    elif step.op == "RUN":
        run_in(root, step.arg)


def build(containerfile: Path, context: Path, root: Path) -> list[str]:
    """The image's root filesystem at ROOT; its entrypoint (ENTRYPOINT + CMD, as a list)."""
    todo = steps(containerfile)
    if not todo or todo[0].op != "FROM":
        raise ValueError(f"{containerfile}: the first step must be FROM")
    cut = next((i for i, s in enumerate(todo) if s.op == "COPY" and any(
        a.startswith("dist/") for a in shlex.split(s.arg)[:-1])), len(todo))
    h = hashlib.sha256(json.dumps([(s.op, s.arg) for s in todo[:cut]]).encode())
    h.update(digest([p for s in todo[:cut] if s.op == "COPY" for p in sources(s, context)], context).encode())
    base = CACHE / f"image-{h.hexdigest()[:16]}"
    if not base.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = base.with_suffix(f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        bootstrap(todo[0].arg, tmp)
        for s in todo[1:cut]:
            apply(s, context, tmp)
        tmp.rename(base)
        for old in CACHE.glob("image-*"):        # an older image's steps: this machine keeps one
            if old != base:
                shutil.rmtree(old, ignore_errors=True)
    subprocess.run(["cp", "-a", f"{base}/.", str(root)], check=True, timeout=300)
    entry: list[str] = []
    for s in todo[cut:]:
        apply(s, context, root)
        if s.op == "ENTRYPOINT":
            entry = json.loads(s.arg)
        elif s.op == "CMD":
            entry = entry + json.loads(s.arg)
    return entry
