"""KV transfer benchmarks: the transfer agents' throughput (transfer.py) and the disaggregated
end-to-end run on real workers (disagg_e2e.py, its parts in disagg/). Each script is run as
`python bench/transfer/<script>.py` (docs/benchmarks.md)."""
