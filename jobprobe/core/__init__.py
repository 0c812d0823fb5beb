"""What node and cluster share, and nothing else: errors, the frame (schema, encoding), the wire contract (subjects,
message ids, name → token), names (the one injective name escape), counters (wrap-safe deltas), retry (backoff
with jitter) and HOST:PORT parsing. Imports nothing of jobprobe outside core/."""
