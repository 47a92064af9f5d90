"""Multi-rank (TP × PP) workers: rank layout and wire (``comm``), the leader's rank group and
runner (``rank_group``), the follower process (``rank_worker``), the sharded model (``tp_model``),
the leader's engine (``engine``) and the per-rank KV transceiver facade (``rank_transfer``).
docs/worker.md ("Multi-rank internals") describes them."""
