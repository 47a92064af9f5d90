"""The coordinator, the one owner of cluster state (registry, health, KV events into the index,
leases, placement), its HTTP API and fleet channel, its clients, and the cluster configuration
every process loads (docs/design.md §1, §6; docs/coordinator-api.md; docs/configuration.md)."""
