"""CosyVoice 2 networks in plain PyTorch, named so the official checkpoints load with strict=True."""
