"""Benchmarks of serving."""
