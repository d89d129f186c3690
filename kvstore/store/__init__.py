"""Format v1 and the page store (DESIGN.md §3-5)."""
