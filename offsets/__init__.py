"""Trained draft offsets shipped with rvqtts (offsets/README.md)."""
