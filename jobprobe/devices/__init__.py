# SPDX-License-Identifier: Apache-2.0
"""Userspace libraries and device files below the probes: NVML (nvml; its codes and device records: nvmltypes), PCI
sysfs (pci), RDMA sysfs (rdma), Python processes and py-spy (pyproc), which GPUs processes may use by
their device cgroup and *_VISIBLE_DEVICES (gpuowner). Import core/ and kernel/ only."""
