"""splitserve fleet package (see docs/design.md §1)."""
