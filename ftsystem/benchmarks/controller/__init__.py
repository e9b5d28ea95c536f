"""``ftsystem bench controller``: membership decision latency of the real controller leader, at
scale, against a real etcd (embedded unless ``--etcd`` names one).

- ``replicas``: n simulated replicas, each with its own lease; one lease revoked at a time, timed
  to the epoch without it (the default).
- ``nodes``: ``--nodes N`` simulated node agents in load-generator processes (``agents``,
  driven through ``fleet``), each with its own lease and keep-alives (``keepalive_streams``,
  ``keepalive_per_call``); the same decision timed under that load, with etcd's rates
  (``etcd_rates``) and the JSON of ``nodes_report``.
- Shared: ``config`` (settings, read by the CLI), ``services`` (etcd and the leader under test,
  as ``ftsystem controller`` in a subprocess by default, so that its event loop does not share a
  core with the load generator; ``--controller in-process`` runs the same leader code as a task,
  which is what a profiler of this command sees), ``epochs`` (the watcher that times epochs),
  ``stats``; ``command`` registers the command.
"""
