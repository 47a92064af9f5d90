"""splitserve transfer package (see docs/design.md §1)."""
