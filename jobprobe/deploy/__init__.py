# SPDX-License-Identifier: Apache-2.0
"""The files a site installs beside the package, shipped in the wheel as package data: the systemd units
(systemd/), the SLURM prolog and epilog (slurm/), the Kubernetes manifest (k8s/). In a checkout they are links to
scripts/; scripts/install.sh copies them from the installed package to PREFIX/share (docs/DEPLOY.md)."""
from pathlib import Path

HERE = Path(__file__).resolve().parent


def files() -> dict[str, Path]:
    """'systemd/jobprobe-agent.service' → its path, for every shipped file."""
    return {str(p.relative_to(HERE)): p for d in ("systemd", "slurm", "k8s") for p in sorted((HERE / d).iterdir())
            if p.is_file()}
