# SPDX-License-Identifier: Apache-2.0
"""What we attach to: the kinds of target, one module each, each a `Target` (jobprobe/contract/target.py: what a
probe is given — which cgroup, which processes now, is the job still there).

- `cgroup`: `CgroupTarget`, a cgroup2 group and its descendants.
- `pidtree`: `PidTreeTarget`, root processes and every descendant.
- `command`: `CommandTarget`, `-- CMD`: a group we create and CMD started inside it; `check_runnable`.
- `slurm`: `slurm_target()`, a SLURM job (its cgroup2 group, else its processes), its labels and steps;
  `slurm_running_jobs()`.
- `k8s`: `k8s_pod_target()`, a Kubernetes pod's cgroup2 group.

Every file read takes a root so the unit tests run on fixture trees.
"""
