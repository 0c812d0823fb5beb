# SPDX-License-Identifier: Apache-2.0
"""The benchmark kit: what each probe costs the job (`jobprobe bench overhead`). Benchmarks are not tests."""
