"""Benchmarks of distributed."""
