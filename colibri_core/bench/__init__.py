"""Benchmarks behind `colibri bench` (results are measurements, never test gates)."""
