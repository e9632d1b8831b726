"""Micro-benchmarks: ``python -m mpo.bench NAME [args]`` runs ``mpo.bench.NAME.main(args)``."""
