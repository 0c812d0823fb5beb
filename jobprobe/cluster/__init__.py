# SPDX-License-Identifier: Apache-2.0
"""The cluster side, which never runs on a node: the controller (checks and consumers of each frame), its JetStream
intake, cluster-wide traces, its own nats-server and its metrics, the frame check of hostile input, the store,
stragglers, the TSDB writer, cost and reports. Imports core/ and transport/ only."""
