"""Benchmarks of data."""
