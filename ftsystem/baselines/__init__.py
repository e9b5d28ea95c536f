"""Baselines that the benchmarks run beside ftsystem, under the same failure scenario.

- ``torchft_replica``: one torchft 0.2.0 replica group (Manager + ProcessGroupGloo) training the
  example workload; run as a process.
- ``torchft_scenario``: starts a torchft Lighthouse and supervised replica processes, kills one
  on a schedule or adds a late joiner, and returns the raw commit timelines.
- ``restart_all`` (with ``restart_all_worker``): synchronous restart-all training, torchrun
  elastic (c10d rendezvous, ``--max-restarts``) over plain DDP with a checkpoint every N steps,
  under the same chaos orders as ftsystem (kill, hang, partition); used by ``bench ettr``.
"""
