# SPDX-License-Identifier: Apache-2.0
"""The node runtime: the agent (its job table and tick), job specs and config, the control socket, targets (what a
job is: a cgroup, a process tree, a SLURM job, a pod), the probe contract (probe, bpfprobe, tickmemo), the
registry, the sampler (one job's probes → one frame per tick), rules and deep-trace windows, the k8s watch, doctor.
Imports core/, kernel/, devices/, exporters/ (sinks) and transport/; never cluster/."""
