"""splitserve router package (see docs/design.md §1)."""
