"""The inner loop as one module: fused for torch.compile and CUDA graphs, exported for Core ML."""
