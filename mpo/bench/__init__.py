"""Benchmarks: `python -m mpo.bench NAME [args]`. Each reports ratios measured in one run on this machine."""
