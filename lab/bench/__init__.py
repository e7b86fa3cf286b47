"""Benchmarks: each prints a table and writes a CSV; speeds are compared with a baseline measured in the same run."""
