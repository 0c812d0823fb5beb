"""One module per probe (found by jobprobe.registry); modules starting with '_' are shared helpers."""
