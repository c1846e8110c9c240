"""Hugging Face Spaces: what the hardware of a Space lets cosyapp do.

Every Space sets ``SPACE_ID``; a ZeroGPU Space also sets ``SPACES_ZERO_GPU=true``, the variable the
``spaces`` package reads to tell it is on ZeroGPU. There cosyapp cannot run (ZERO_GPU_MESSAGE says
why) and refuses to start; on a Space without a GPU it runs the demo model.
"""

from collections.abc import Mapping

ZERO_GPU_MESSAGE = """\
cosyapp cannot run on ZeroGPU hardware.
ZeroGPU lends a GPU to one decorated function call at a time and takes it back when the call
returns. cosyapp holds its GPU for as long as it runs: the vLLM engine (its own process, with the
LM weights, KV cache and CUDA graphs), the flow and vocoder with their CUDA graphs, and the
streaming flow cache stay on the card between requests, and one engine serves every session at once.
Choose dedicated GPU hardware in the Space's settings (an L4 with 24 GB or larger), or CPU hardware
to try the interface with the demo model."""

CPU_SPACE_REASON = (
    "this Space runs on CPU hardware; choose a GPU (an L4 or larger) in the Space's settings "
    "to serve the real model"
)


def on_space(environ: Mapping[str, str]) -> bool:
    """Whether this process runs in a Hugging Face Space."""
    return bool(environ.get("SPACE_ID"))


def on_zero_gpu(environ: Mapping[str, str]) -> bool:
    """Whether this Space runs on ZeroGPU hardware (read as the ``spaces`` package reads it)."""
    return environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")
