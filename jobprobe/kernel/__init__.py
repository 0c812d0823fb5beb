# SPDX-License-Identifier: Apache-2.0
"""The kernel's interfaces, one module each, below every probe: bpf(2) itself (bpf), BPF maps and ring buffers
(bpfmap), loading programs through the short-lived bcc loader process (bpfload, bpf_loader), the node's job
membership (membership), perf_event_open (perf), uprobes (uprobe), ELF symbols (elf), BTF (btf), the cgroup
device-program interpreter (devcg), taskstats exit records (taskstats), per-process and per-thread accounting
from /proc and those records (threadacct), the sched counters' per-CPU slots read whole (schedread), rtnetlink
(rtnl), RDMA netlink (rdmanl), a driver's ethtool statistics (ethtool), names for kernel and user addresses
(symbols), what this host can do (host), and the one reader each of /proc/PID/stat and /proc/PID/cgroup (procfs)
and of tracefs event formats (tracefs). Userspace libraries and device files (NVML, PCI and RDMA sysfs, Python
processes) are in jobprobe.devices. kernel/ imports only jobprobe.core and itself (and jobprobe.bpf, the C
sources it compiles); probes/ holds probes only.
"""
