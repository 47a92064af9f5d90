"""splitserve coordinator package (see docs/design.md §1)."""
