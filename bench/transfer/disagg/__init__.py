"""The parts of bench/transfer/disagg_e2e.py (the command line): workload, streaming client, clusters of
real processes, the KV-transfer part, one configuration's end-to-end run, and the report."""
