"""The example replica program of ``ftsystem run`` and its model and data."""
