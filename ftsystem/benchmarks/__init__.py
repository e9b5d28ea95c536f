"""Benchmarks: each is a ``ftsystem bench`` sub-command that prints a table and writes JSON.

Those that compare ftsystem with baselines launch every system from one run spec
(``harness.RunSpec``), so that all of them train the same thing.
"""
