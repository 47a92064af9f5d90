"""Benchmarks, grouped by subject (routing/, coordinator/, fleet/, worker/, transfer/), each script
run as `python bench/<subject>/<script>.py` (docs/benchmarks.md); results in bench/RESULTS.md."""
