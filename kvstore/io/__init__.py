"""I/O engines moving block bytes between memory and files."""
