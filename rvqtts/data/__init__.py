"""Data shipped with rvqtts: trees/ and offsets/ of the repository, read through importlib.resources."""
