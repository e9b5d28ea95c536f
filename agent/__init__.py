"""The ftsystem node agent (``ftsystem agent``): supervises one replica's processes."""
