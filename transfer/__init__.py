"""splitserve transfer package (see DESIGN.md §1)."""
