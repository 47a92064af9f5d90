"""Garbage-collector settings of the long-running processes (coordinator, fleet), in one place.

`settle_heap()` runs once a process is up:
- `gc.collect(); gc.freeze()`: modules, configuration, tokenizer and start-up KV indexes live as
  long as the process; frozen, they stay out of every later full collection. Before, full
  collections of a 32-server coordinator took 16-37 ms each (its select p99).
- young-generation threshold 50,000 allocations instead of 700: at 700 each collection found the
  objects of the requests in flight alive and promoted them, the old generation filled with
  objects that die moments later and full collections ran every few seconds over every
  connection's state. A one-process fleet at 256 connections spent 176 ms of CPU per 7 s in
  collections (68 of them over 1 ms); with 50,000, 49 ms (8) — most of a request's objects are
  freed by reference counting before the next collection (bench runs in docs/coordinator-api.md).
"""
from __future__ import annotations

import gc

THRESHOLDS = (50_000, 20, 20)


def settle_heap() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
