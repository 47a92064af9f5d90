"""The reference inference worker: an OpenAI-compatible server over a torch model or the `sim`
engine, with its scheduler, paged KV cache, KV-event publisher and KV connector
(docs/design.md §8; docs/worker.md)."""
