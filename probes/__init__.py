# SPDX-License-Identifier: Apache-2.0
"""One module per probe, found by jobprobe.node.registry by its `name`; nothing else lives here. What probes share
is below them: the probe contract in jobprobe/node/ (probe, bpfprobe, tickmemo, the Target base), the mechanisms in
jobprobe/kernel/ and jobprobe/devices/."""
