"""Fleet benchmarks: throughput and CPU per request of the fleet paths against nginx mocks (fleet.py),
their A/B and instruction counts between trees, where a request waits, metrics cost, pacing and the
engine protocols. Each script is run as `python bench/fleet/<script>.py` (docs/benchmarks.md)."""
