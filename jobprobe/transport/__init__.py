"""Getting frames off the node and into the controller: the agent's own NATS client (natswire: the text protocol,
TLS, nkey/creds signing) and the controller's nats-server auth (natsauth: nkeys, enrolment, permissions).
Imports core/ only."""
