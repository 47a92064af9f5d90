"""Engine block-hash recipes (vLLM, SGLang, TensorRT-LLM, Dynamo), reimplemented byte for byte.

Routing never depends on these: the index is keyed by canonical keys (``router.block_keys``).
They exist for the optional engine-hash mode and as cross-checks in tests
(docs/routing.md "Block keys"; each module names the engine file it follows, and
tests/router/test_recipes.py holds the byte-level vectors).
"""
