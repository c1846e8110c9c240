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

PIECES = ((TransformerBlock, "qkv"), (TransformerBlock, "after_attention"), (CausalBlock1D, "finish"))


@functools.cache
def _compiled(cls: type, name: str):
    return torch.compile(getattr(cls, name), dynamic=True)


def fuse_estimator(estimator: CausalConditionalDecoder, cache_dir: Path | None = None) -> None:
    """Run ``estimator``'s memory-bound pieces through their compiled versions, in place.

    cache_dir: where inductor keeps compiled kernels, so a restart reuses them; a
    TORCHINDUCTOR_CACHE_DIR set by the user wins. Compiling happens on each piece's first call (the
    start-up warm-up).
    """
    if cache_dir is not None:
        _use_cache_dir(cache_dir)
    for module in estimator.modules():
        for cls, name in PIECES:
            if isinstance(module, cls):
                # An instance attribute shadows the class's method for this module only.
                setattr(module, name, functools.partial(_compiled(cls, name), module))


def _use_cache_dir(folder: Path) -> None:
    """Point inductor's cache at ``folder`` unless the user chose one. Importing torch._dynamo writes
    inductor's default into TORCHINDUCTOR_CACHE_DIR, so only another value is the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
