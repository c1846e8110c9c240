"""Running where users run cosyapp: serving defaults sized to the GPU, hosting platforms (Spaces).

sizing.py: the stream limit and vLLM's share from the card's memory.
space.py: Hugging Face Spaces; ZeroGPU refused with an explanation, CPU hardware runs the demo model.
plugin.py: vLLM's plugin entry point for a source tree that is not pip-installed (a Space).
"""
