"""The cluster side, which never runs on a node: the controller (NATS consumer, checks, consumers), the frame
check of hostile input, the store, stragglers, the TSDB writer, cost and reports. Imports core/ and transport/
only."""
