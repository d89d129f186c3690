"""Tests of kvstore.layout (canonical mapping of parallel layouts)."""
