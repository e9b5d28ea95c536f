"""The control plane: etcd access, the keyspace, membership decisions, deadlines."""
