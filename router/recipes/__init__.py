"""Engine block-hash recipes (vLLM, SGLang, TensorRT-LLM, Dynamo), reimplemented byte for byte.

Routing never depends on these: the index is keyed by canonical keys (``router.block_keys``).
They exist for the optional engine-hash mode and as cross-checks in tests
(docs/reference/kv_events.md §3, §6.2, §7.2, §5.1, vectors in §10).
"""
