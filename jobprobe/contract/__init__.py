# SPDX-License-Identifier: Apache-2.0
"""The probe contract, a room of its own below probes/ and node/: what a probe is (`probe`: Probe, Field, the
declarations a frame's schema comes from; `bpfprobe`: an eBPF probe sharing one load per node), what it is given
(`target`: the job it watches) and the per-tick memo every job's probes share (`tickmemo`). Probes and the node
runtime both import it; it imports only core, kernel and devices.
"""
