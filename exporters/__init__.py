# SPDX-License-Identifier: Apache-2.0
"""One module per sink: file, stdout, prometheus, nats — and queued, the bounded queue and thread each sink sits
behind. Sinks take finished frames (a dict and its encoded bytes) and know nothing of probes; they import
jobprobe.core and jobprobe.transport only."""
