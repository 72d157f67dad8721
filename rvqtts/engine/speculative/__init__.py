"""Speculative decoding of the residual codes: trees, draft offsets, one round's verification walk, and the
tree size chosen per platform or online."""
