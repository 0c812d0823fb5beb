"""The kernel's interfaces, one module each, below every probe: bpf(2) and the bcc loader process (bpf,
bpf_loader), the node's job membership (membership), perf_event_open (perf), uprobes (uprobe), ELF symbols (elf),
BTF (btf), the cgroup device-program interpreter (devcg), NVML (nvml), taskstats exit records (taskstats), and the
one reader each of /proc/PID/stat and /proc/PID/cgroup (procfs) and of tracefs event formats (tracefs).
They import only jobprobe.core.errors, jobprobe.kernel.host and each other; probes/ holds probes only.
"""
