"""One module per sink. Exporters take finished frames (dicts) and know nothing of probes."""
