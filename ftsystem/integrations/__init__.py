"""Training frameworks run under ftsystem: each module adapts one (``torchtitan``) and is
imported only by programs that use it, with that framework installed (``ftsystem[torchtitan]``)."""
