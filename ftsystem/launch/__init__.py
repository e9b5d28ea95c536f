"""Launching: a whole job on this machine (``ftsystem run``), children, emulated hosts."""
