"""Benchmarks behind `colibri bench …`: measurements, never test gates."""
