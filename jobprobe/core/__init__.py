# SPDX-License-Identifier: Apache-2.0
"""What node and cluster share, and nothing else: errors, the frame (schema, encoding), the wire contract (subjects,
message ids, node → token, HOST:PORT parsing), names (the one injective name escape), counters (wrap-safe deltas,
log2 percentiles), metrics (a frame's numbers as Prometheus metrics), schema (every probe's declared fields,
generated), retry (backoff with jitter) and child (stopping a child process within a time). Imports nothing of
jobprobe outside core/."""
