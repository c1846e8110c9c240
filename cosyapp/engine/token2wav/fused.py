"""The flow estimator's memory-bound work compiled by torch.compile (inductor): ``--compile-flow``.

Eager, the estimator's LayerNorms, Mish, GELU, mask multiplies and residual adds are a kernel each
and take about half of an H200's time at batch 64 (docs/model.md §6.6). The estimator keeps that
work in three methods that the recompute and the incremental flow both call
(``TransformerBlock.qkv`` and ``after_attention``, ``CausalBlock1D.finish``); here each is compiled
once with dynamic shapes and put on every instance, so one compiled graph serves all the blocks
(the modules are inlined, their parameters are graph inputs) and the pointwise work around each
LayerNorm and GEMM runs as one kernel. Attention and the convolutions stay as they are.

Inductor runs here without CUDA graphs of its own: the graphs of graphs.py and incremental.py
capture the compiled kernels. Results match eager within float rounding.
"""

import functools
import os
from pathlib import Path

import torch

from cosyapp.models.flow_estimator import CausalBlock1D, CausalConditionalDecoder, TransformerBlock
from cosyapp.models.hift import HiFTGenerator, Snake, snake

PIECES = ((TransformerBlock, "qkv"), (TransformerBlock, "after_attention"), (CausalBlock1D, "finish"))


@functools.cache
def _compiled(cls: type, name: str, mode: str | None):
    return torch.compile(getattr(cls, name), dynamic=True, mode=mode)


def fuse_estimator(
    estimator: CausalConditionalDecoder, cache_dir: Path | None = None, mode: str | None = None
) -> None:
    """Run ``estimator``'s memory-bound pieces through their compiled versions, in place.

    cache_dir: where inductor keeps compiled kernels, so a restart reuses them; a
    TORCHINDUCTOR_CACHE_DIR set by the user wins. Compiling happens on each piece's first call (the
    start-up warm-up). mode: torch.compile's (None: its default); "max-autotune-no-cudagraphs" also
    times Triton templates for the matrix products, with the pointwise work after them fused in, and
    picks them where they beat the library's (scripts/flow_compile_speed.py measures it).
    """
    if cache_dir is not None:
        use_cache_dir(cache_dir)
    for module in estimator.modules():
        for cls, name in PIECES:
            if isinstance(module, cls):
                # An instance attribute shadows the class's method for this module only.
                setattr(module, name, functools.partial(_compiled(cls, name, mode), module))


def fuse_hift(hift: HiFTGenerator, cache_dir: Path | None = None, mode: str | None = None) -> None:
    """Run each of ``hift``'s Snake activations as one compiled kernel, in place.

    A Snake is x + sin(alpha x)^2 / alpha: eager, five kernels that each read and write the whole
    (B, C, T) activation, at up to 120 samples per mel frame; HiFT runs 72 of them per call. Compiled
    with dynamic shapes, one graph serves every Snake of every stage (channels, length and batch
    vary; alpha goes in as a plain tensor, as a parameter's shape would be fixed per graph), and one
    more batch-1 calls; the convolutions stay as they are. Results match eager within float
    rounding (the compiled sine is not bit for bit the eager one). cache_dir, mode: as
    ``fuse_estimator``.
    """
    if cache_dir is not None:
        use_cache_dir(cache_dir)
    compiled = _compiled_snake(mode)
    for module in hift.modules():
        if isinstance(module, Snake):
            module.forward = functools.partial(_snake_with, compiled, module)


@functools.cache
def _compiled_snake(mode: str | None):
    return torch.compile(snake, dynamic=True, mode=mode)


def _snake_with(compiled, module: Snake, x: torch.Tensor) -> torch.Tensor:
    return compiled(x, module.alpha.detach())


def use_cache_dir(folder: Path) -> None:
    """Point inductor's cache at ``folder`` unless the user chose one. Importing torch._dynamo writes
    inductor's default into TORCHINDUCTOR_CACHE_DIR, so only another value is the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
