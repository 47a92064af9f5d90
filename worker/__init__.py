"""splitserve worker package (see DESIGN.md §1)."""
