"""Benchmarks: each prints a table and writes a CSV; speeds are compared with a baseline measured in the same run.

May import: every room of ``lab`` but ``cli``, and ``paged_kernels``."""
