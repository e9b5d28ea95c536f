"""ftsystem: fault-tolerant orchestration for large data-parallel training jobs."""

__version__ = "0.1.0"
