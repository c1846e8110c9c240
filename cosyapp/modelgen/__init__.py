"""Model folders of our own in the official layout with random weights: demo, tests, benchmarks."""
