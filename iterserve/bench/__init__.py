"""Benchmarks: the decode micro-benchmark now; load generation and baselines later."""
