"""Routing benchmarks: the router core (router_core.py), placement calls (placement.py) and the
trace-replay routing quality on sim workers (routing.py, routing_aiperf.py). Each script is run as
`python bench/routing/<script>.py` (docs/benchmarks.md)."""
