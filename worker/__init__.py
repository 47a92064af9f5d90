"""splitserve worker package (see docs/design.md §1)."""
