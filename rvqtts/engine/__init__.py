"""The engine, in four layers: model/ (the networks, kernels and sampling), speculative/ (trees, offsets, rounds and
the tree size chosen), backends/ (the inner loop as one module: fused, Core ML) and loop/ (the frame loop and the
inner loop). docs/architecture.md draws them."""
