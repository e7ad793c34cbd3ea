"""The torch.compile backend: pass pipeline, region executor, piecewise CUDA graphs, fallbacks."""
