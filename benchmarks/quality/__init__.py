"""Benchmarks of quality."""
