"""Token-to-wave: the batched flow + HiFT worker, per-stream chunking and state, CUDA graphs."""
