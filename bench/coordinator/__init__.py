"""Coordinator benchmarks: HTTP and channel latency under open-loop load (coordinator.py, its load
generator coordinator_load.py) and a long-lived coordinator against fresh ones (coordinator_aging.py).
Each script is run as `python bench/coordinator/<script>.py` (docs/benchmarks.md)."""
