"""The ftsystem controller service (``ftsystem controller``): membership epochs and the REST API."""
