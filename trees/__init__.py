"""Tree shapes, acceptance tables and best tree sizes shipped with rvqtts (docs/acceptance.md)."""
