"""Simulators for scales that do not fit on the machines here (``ftsystem sim ...``)."""
