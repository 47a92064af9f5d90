"""The contracts every package of splitserve shares, in one place (docs/design.md §1).

This package imports no other package of ours (tests/test_layering.py), and every other package
may import it. Each contract lives in exactly one module here:

- `protocol.roles`     — server roles and placement / serving modes (the wire spellings).
- `protocol.failures`  — typed failure causes (connect refused, timeout, upstream 5xx, peer lost,
  overloaded): decisions branch on these, never on error text.
- `protocol.coord`     — the coordinator API: request and answer structs, the body codec.
- `protocol.channel`   — the fleet↔coordinator channel frames.
"""
