"""The worker's paged KV block pool and prefix cache (pure data structure, no tensors).

Both engines use it: the torch engine maps block ids onto slices of its K/V tensors, the sim
engine keeps only this bookkeeping. A block is identified by an int in ``[0, num_blocks)``.

Invariants (checked by ``check_invariants`` and the property tests):

* Every block is in exactly one of three states:
  - **free**: ref count 0, no key, in the free list;
  - **cached** (unreferenced): ref count 0, has a key, in the LRU list (evictable);
  - **referenced**: ref count > 0 (running request, pin, or both), with or without a key.
  ``num_free + num_cached + num_used == num_blocks`` at all times.
* A key names at most one block (``_by_key`` is a bijection onto blocks that have a key).
* A block gets a key only through ``commit`` (or ``commit_run``) of a *full* block; it loses it only through eviction
  (``allocate`` taking an LRU block: ``BlocksRemoved``) or ``clear`` (``AllCleared``). So the
  sequence of drained events, applied to an empty set, always yields ``resident_keys()``.
* Each committed block's parent key (if any) is resident when the block is committed, so every
  ``BlocksStored`` event links to a block the subscriber already knows.
* Per-request block tables belong to the caller; the pool only counts references.

Freeing a request's blocks puts them into the LRU list tail-first, so a sequence's last block is
evicted before its first: an evicted prefix would make every later block unreachable anyway.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from router.events import AllCleared, BlocksRemoved, BlocksStored

__all__ = ["BlockPool", "NoFreeBlocks", "BlockPoolError"]


class BlockPoolError(ValueError):
    """A caller broke the pool's contract (double free, commit of a free block, ...)."""


class NoFreeBlocks(RuntimeError):
    """``allocate(n)`` asked for more blocks than are free or evictable right now."""

    def __init__(self, requested: int, available: int):
        super().__init__(f"need {requested} KV blocks, only {available} free or evictable")
        self.requested = requested
        self.available = available


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, ns_seed: int = 0):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.ns_seed = int(ns_seed)
        self._ref = [0] * self.num_blocks
        self._key: list[int | None] = [None] * self.num_blocks
        self._pins = [0] * self.num_blocks
        # Popping from the end keeps low block ids in use first (nicer to read in tests/dumps).
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._by_key: dict[int, int] = {}
        self._events: list = []
        self._num_used = 0
        self._num_pinned = 0
        # Counters (monotonic) for metrics.
        self.evictions = 0
        self.hit_blocks = 0

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks holding nothing (not referenced, not cached)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for prefix hits (evictable)."""
        return len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference (requests or pins)."""
        return self._num_used

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out now (free + evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_pinned(self) -> int:
        """Blocks with at least one pin (a subset of ``num_used``)."""
        return self._num_pinned

    def ref_count(self, block_id: int) -> int:
        return self._ref[self._check_id(block_id)]

    def key_of(self, block_id: int) -> int | None:
        return self._key[self._check_id(block_id)]

    def block_of(self, key: int) -> int | None:
        return self._by_key.get(int(key))

    # ------------------------------------------------------------- allocation
    def allocate(self, n: int) -> list[int]:
        """Return ``n`` blocks with ref count 1, evicting least recently used cached blocks
        (one ``BlocksRemoved`` event for the lot) when the free list runs out."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_available:
            raise NoFreeBlocks(n, self.num_available)
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                key = self._key[b]
                self._key[b] = None
                del self._by_key[key]
                evicted.append(key)
            self._ref[b] = 1
            out.append(b)
        self._num_used += n
        if evicted:
            self.evictions += len(evicted)
            self._events.append(BlocksRemoved(engine_hashes=evicted, group=0))
        return out

    def free(self, block_ids) -> None:
        """Drop one reference from each block. At 0 a block with a key becomes cached (LRU),
        otherwise free. Blocks are taken last-first so a sequence's tail is evicted first."""
        for b in reversed(list(block_ids)):
            self._decref(self._check_id(b))

    def _decref(self, b: int) -> None:
        r = self._ref[b]
        if r <= 0:
            raise BlockPoolError(f"block {b} freed more often than referenced (ref count {r})")
        r -= 1
        self._ref[b] = r
        if r == 0:
            self._num_used -= 1
            if self._key[b] is not None:
                self._lru[b] = None
            else:
                self._free.append(b)

    def _incref(self, b: int) -> None:
        if self._ref[b] == 0:
            if b in self._lru:
                del self._lru[b]
            else:
                raise BlockPoolError(f"block {b} is free; only cached or referenced blocks can be shared")
            self._num_used += 1
        self._ref[b] += 1

    # ----------------------------------------------------------- prefix cache
    def match_prefix(self, keys) -> list[int]:
        """Longest run of cached blocks for ``keys`` (chain order), each incref'd.

        The caller caps the hit so at least one prompt token is computed, and frees the blocks it
        does not use."""
        out: list[int] = []
        by_key = self._by_key
        for k in keys:
            b = by_key.get(int(k))
            if b is None:
                break
            out.append(b)
        for b in out:
            self._incref(b)
        self.hit_blocks += len(out)
        return out

    def commit(self, block_id: int, key: int, parent_key: int | None, token_ids) -> bool:
        """Register the *full*, referenced block ``block_id`` under its canonical ``key``.

        Returns True when the block became a prefix-cache entry (``BlocksStored`` event). Returns
        False, changing nothing, when the key is already resident in another block (two requests
        computed the same prefix concurrently) or when the parent is no longer resident (the block
        could never be reached by a prefix walk, and subscribers could not link it)."""
        tokens = [int(t) for t in token_ids]
        if not self._commit_one(block_id, key, parent_key, tokens):
            return False
        self._stored([int(key)], parent_key, tokens)
        return True

    def commit_run(self, block_ids, keys, parent_key: int | None, token_ids) -> int:
        """``commit`` of consecutive blocks of one sequence: ``keys[i]`` chains onto ``keys[i - 1]``
        (the first onto ``parent_key``) and ``token_ids`` holds ``block_size`` tokens per block.
        The same outcome and events as one ``commit`` per block, at a fraction of the host time:
        one ``BlocksStored`` per run of stored blocks instead of one per block (a generation
        worker commits a whole received prompt in the step that makes its first token: 512
        blocks at 8k tokens). Returns how many blocks were stored."""
        B = self.block_size
        tokens = [int(t) for t in token_ids]
        if len(tokens) != B * len(block_ids) or len(keys) != len(block_ids):
            raise BlockPoolError(f"commit_run: expected {len(block_ids)} keys and "
                                 f"{B * len(block_ids)} tokens for {len(block_ids)} blocks; "
                                 f"found {len(keys)} and {len(tokens)}")
        stored, run, run_parent = 0, [], parent_key
        prev = parent_key
        for i, (b, k) in enumerate(zip(block_ids, keys)):
            k = int(k)
            if self._commit_one(b, k, prev, tokens[i * B:(i + 1) * B]):
                if not run:
                    run_parent, first = prev, i
                run.append(k)
                stored += 1
            elif run:
                self._stored(run, run_parent, tokens[first * B:(first + len(run)) * B])
                run = []
            prev = k
        if run:
            self._stored(run, run_parent, tokens[first * B:(first + len(run)) * B])
        return stored

    def _commit_one(self, block_id, key, parent_key, tokens: list[int]) -> bool:
        """``commit``'s checks and bookkeeping, without its event."""
        b = self._check_id(block_id)
        key = int(key)
        if self._ref[b] <= 0:
            raise BlockPoolError(f"commit of block {b} which holds no reference")
        if len(tokens) != self.block_size:
            raise BlockPoolError(
                f"commit of block {b} with {len(tokens)} tokens; only full blocks "
                f"({self.block_size} tokens) are cached")
        current = self._key[b]
        if current is not None:
            if current == key:
                return False
            raise BlockPoolError(f"block {b} already committed under key {current}, not {key}")
        if key in self._by_key:
            return False
        if parent_key is not None and int(parent_key) not in self._by_key:
            return False
        self._key[b] = key
        self._by_key[key] = b
        return True

    def _stored(self, keys: list[int], parent_key, tokens: list[int]) -> None:
        # Our engine hash *is* the canonical key (docs/worker.md, "HTTP contract"); group 0 as vLLM's
        # single-group models publish.
        self._events.append(BlocksStored(
            engine_hashes=keys, parent_engine_hash=None if parent_key is None else int(parent_key),
            token_ids=tokens, engine_block_size=self.block_size, group=0))

    def clear(self) -> None:
        """Forget every cached key (``AllCleared``). Referenced blocks stay allocated but lose
        their keys, so they become free, not cached, when released."""
        for b in self._lru:
            self._key[b] = None
            self._free.append(b)
        self._lru.clear()
        for b in self._by_key.values():
            self._key[b] = None
        self._by_key.clear()
        self._events.append(AllCleared())

    # ------------------------------------------------------------------ pins
    def pin(self, block_ids) -> None:
        """Hold blocks for a KV transfer; a pin is a reference, released by ``unpin``."""
        ids = [self._check_id(b) for b in block_ids]
        for b in ids:
            if self._ref[b] == 0 and b not in self._lru:
                raise BlockPoolError(f"cannot pin free block {b}")
        for b in ids:
            self._incref(b)
            if self._pins[b] == 0:
                self._num_pinned += 1
            self._pins[b] += 1

    def unpin(self, block_ids) -> None:
        ids = [self._check_id(b) for b in block_ids]
        for b, n in Counter(ids).items():
            if self._pins[b] < n:
                raise BlockPoolError(f"unpin of block {b} {n}x, but it is pinned {self._pins[b]}x")
        for b in reversed(ids):
            self._pins[b] -= 1
            if self._pins[b] == 0:
                self._num_pinned -= 1
            self._decref(b)

    # ---------------------------------------------------------------- events
    def drain_events(self) -> list:
        """Events since the last drain, in order; consecutive single-block stores that chain onto
        each other are merged into one ``BlocksStored`` (as vLLM does per request)."""
        evs, self._events = self._events, []
        out: list = []
        for ev in evs:
            prev = out[-1] if out else None
            if (isinstance(ev, BlocksStored) and isinstance(prev, BlocksStored)
                    and ev.parent_engine_hash is not None
                    and ev.parent_engine_hash == prev.engine_hashes[-1]):
                prev.engine_hashes.extend(ev.engine_hashes)
                prev.token_ids.extend(ev.token_ids)
            elif isinstance(ev, BlocksRemoved) and isinstance(prev, BlocksRemoved):
                prev.engine_hashes.extend(ev.engine_hashes)
            else:
                out.append(ev)
        return out

    @property
    def has_pending_events(self) -> bool:
        return bool(self._events)

    def resident_keys(self) -> list[int]:
        """Keys of every block that has one (referenced or cached): what subscribers see."""
        return list(self._by_key)

    # ---------------------------------------------------------------- checks
    def _check_id(self, block_id) -> int:
        b = int(block_id)
        if not 0 <= b < self.num_blocks:
            raise BlockPoolError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return b

    def check_invariants(self) -> None:
        """Raise AssertionError when any invariant in the module docstring is broken."""
        free = set(self._free)
        lru = set(self._lru)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert not (free & lru), "block both free and cached"
        used = 0
        for b in range(self.num_blocks):
            r, k = self._ref[b], self._key[b]
            assert r >= 0, f"negative ref count on block {b}"
            assert self._pins[b] <= r, f"block {b} pinned {self._pins[b]}x with only {r} refs"
            if r > 0:
                used += 1
                assert b not in free and b not in lru, f"referenced block {b} on a list"
            elif k is None:
                assert b in free, f"unreferenced uncached block {b} not free"
            else:
                assert b in lru, f"unreferenced cached block {b} not in LRU"
            if k is not None:
                assert self._by_key.get(k) == b, f"key of block {b} not indexed"
        assert used == self._num_used, f"used count {self._num_used} != {used}"
        assert len(self._by_key) == sum(1 for k in self._key if k is not None)
        assert self.num_free + self.num_cached + self.num_used == self.num_blocks
        assert self._num_pinned == sum(1 for p in self._pins if p), "pinned count drifted"
