"""splitserve fleet package (see DESIGN.md §1)."""
