"""The finite-cache affinity bound of bench/routing/routing.py: what the workers' caches could hold
if every prefix tree stayed on one server, computed offline from the trace (outside the product).

- prefix trees: the trie of the requests' block-id paths is cut where a node's subtree carries at
  most 1/n of all prompt tokens (a shared system prompt above the cut belongs to no one tree:
  every server that needs it caches it); each tree goes whole to one server: in trie order
  (siblings next to each other), each server takes trees until it holds 1/n of the prompt
  tokens, so load is as even as whole trees allow and subtrees of one prefix share servers;
- each server is a sequential LRU cache of `capacity` blocks: requests in arrival order, a
  request's hit is the longest prefix of its blocks resident on its server (capped one token
  short of the prompt, as an engine recomputes the last token), then all its blocks become the
  most recently used (evicting the least recently used). No concurrency: a block is cached the
  moment its request arrives, which no real cluster beats.

The hit ratio is in the replay's tokens (`per_block` synthetic tokens per 512-token trace block),
as the workers report it.
"""
from __future__ import annotations

import math
from collections import OrderedDict, defaultdict

TRACE_BLOCK = 512


def _tokens(r, per_block: int) -> int:
    return max(1, math.ceil(r.input_length * per_block / TRACE_BLOCK))


def trees(reqs, n_servers: int, per_block: int) -> list[tuple]:
    """Each request's tree key (a block-id path prefix)."""
    load: dict[tuple, int] = defaultdict(int)
    total = 0
    for r in reqs:
        t = _tokens(r, per_block)
        total += t
        path = ()
        for h in r.hash_ids:
            path += (h,)
            load[path] += t
    cut = total / max(1, n_servers)
    keys = []
    for r in reqs:
        path = ()
        for h in r.hash_ids:
            path += (h,)
            if load[path] <= cut:
                break
        keys.append(path)
    return keys


def affinity_bound(reqs, n_servers: int, capacity_blocks: int, per_block: int,
                   block_size: int = 16) -> dict:
    """{hit_ratio, trees, max_over_mean_load} of the bound for `reqs` on `n_servers` servers of
    `capacity_blocks` blocks of `block_size` tokens each."""
    keys = trees(reqs, n_servers, per_block)
    tree_load: dict[tuple, int] = defaultdict(int)
    for r, k in zip(reqs, keys):
        tree_load[k] += _tokens(r, per_block)
    server_load = [0] * n_servers
    home: dict[tuple, int] = {}
    share = sum(tree_load.values()) / n_servers
    s = 0
    for k in sorted(tree_load):
        if server_load[s] >= share and s < n_servers - 1:
            s += 1
        home[k] = s
        server_load[s] += tree_load[k]
    # capacity in trace blocks: one trace block is per_block tokens = per_block / block_size blocks
    cap = max(1, int(capacity_blocks * block_size / per_block))
    caches = [OrderedDict() for _ in range(n_servers)]
    prompt = hit = 0
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].t_s, i))
    for i in order:
        r = reqs[i]
        n = _tokens(r, per_block)
        c = caches[home[keys[i]]]
        m = 0
        for h in r.hash_ids:
            if h not in c:
                break
            m += 1
        hit += min(m * per_block, n - 1)
        prompt += n
        for h in r.hash_ids[:math.ceil(n / per_block)]:
            c[h] = None
            c.move_to_end(h)
        while len(c) > cap:
            c.popitem(last=False)
    mean = sum(server_load) / n_servers
    return {"hit_ratio": hit / prompt if prompt else 0.0, "trees": len(tree_load),
            "max_over_mean_load": max(server_load) / mean if mean else float("nan"),
            "capacity_trace_blocks": cap}
