"""Userspace libraries and device files below the probes: NVML (nvml), PCI sysfs (pci), RDMA sysfs (rdma), Python
processes and py-spy (pyproc). Import core/ and kernel/ only."""
