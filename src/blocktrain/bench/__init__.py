"""Benchmarks: scripts that print tables and write JSON."""
