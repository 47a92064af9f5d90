"""The contracts every package of splitserve shares, in one place (docs/design.md §1).

This package imports no other package of ours (tests/test_layering.py), and every other package
may import it. Each contract lives in exactly one module here:

- `protocol.roles`     — server roles and placement / serving modes (the wire spellings).
- `protocol.failures`  — typed failure causes (connect refused, timeout, upstream 5xx, peer lost,
  overloaded): decisions branch on these, never on error text.
- `protocol.coord`     — the coordinator API: errors, request and answer structs, the body codec.
- `protocol.channel`   — the fleet↔coordinator channel frames.
- `protocol.disagg`    — `disaggregated_params` and the context→generation opaque state.
- `protocol.openai`    — OpenAI error bodies and request-field validation (fleet and worker).
- `protocol.kv_replay` — the KV-event replay framing and the `/kv_snapshot` body.
- `protocol.version`   — splitserve's version (the installed package's metadata).
- `protocol.logs`      — the one log format of every process (text or JSON lines).
- `protocol.tasks`     — stopping background tasks: cancel, wait, swallow their end but not the
  caller's own cancellation.
- `protocol.prompt`    — the prompt→token-ids recipe (tokenizer loading, chat template, message
  text), with the tokenizers it builds: `protocol.tokenizer`, `protocol.gguf_tokenizer`,
  `protocol.named_models`.
"""
