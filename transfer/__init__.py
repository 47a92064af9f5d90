"""KV-cache movement between workers: page tables, mappers, the NIXL and fallback agents, and the
per-rank sessions a worker drives through one `Transceiver` (docs/design.md §9; docs/kv-transfer.md).
Imported by the worker only."""
