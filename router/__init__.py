"""splitserve router package (see DESIGN.md §1)."""
