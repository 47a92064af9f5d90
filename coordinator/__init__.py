"""splitserve coordinator package (see DESIGN.md §1)."""
