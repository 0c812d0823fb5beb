# SPDX-License-Identifier: Apache-2.0
"""jobprobe: attach to one training job, sample probes every tick, emit one msgpack frame per job per tick."""

__version__ = "0.1.0"
