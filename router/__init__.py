"""The routing core, pure and synchronous (no I/O; `now` is always a parameter): block keys,
KV-event codecs, the KV index, leases, the pairing rules and the four routing policies
(docs/design.md §1; docs/routing.md)."""
