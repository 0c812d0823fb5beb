# SPDX-License-Identifier: Apache-2.0
"""Getting frames off the node and into the controller: the agent's own NATS client (natswire: the text protocol,
TLS), credentials (creds and nkey files, nkey signing, client TLS, nats-py options: one path for agent and
controller) and the controller's nats-server auth (natsauth: nkeys, enrolment, permissions). Imports core/ only."""
