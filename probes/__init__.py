"""One module per probe (found by jobprobe.node.registry); modules starting with '_' are shared helpers."""
