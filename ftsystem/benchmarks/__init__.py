"""Benchmarks: each is a ``ftsystem bench`` sub-command that prints a table and writes JSON."""
