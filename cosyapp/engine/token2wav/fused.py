"""The flow estimator and HiFT compiled by torch.compile (inductor): ``--compile-flow``, ``--compile-hift``.

Eager, the estimator's LayerNorms, Mish, GELU, casts, mask multiplies and residual adds are a kernel
each and take about half of the GPU's time at batch 64 (docs/model.md §6.6). ``--compile-flow``:

- the estimator's forward (the recompute path: whole clips, each stream's final chunk at full
  attention, and chunks that fall back) is compiled whole, one graph with dynamic shapes per
  attention mode, so the pointwise work between the matrix products and attention is fused across
  each block. Measured on an H100 (docs/benchmarks/README.md, "Compiling the flow"): 1.27x, 1.34x
  and 1.46x on 1, 16 and 64 whole clips, after 136-148 s of compiling per mode from an empty cache.
- the incremental flow's step (engine/token2wav/incremental.py) calls the estimator's modules
  itself, so there the memory-bound pieces it shares with the forward
  (``TransformerBlock.after_attention``, ``CausalBlock1D.finish``) are compiled once each with
  dynamic shapes and put on every instance: one compiled graph serves all the blocks (the modules
  are inlined, their parameters are graph inputs). The forward's graph inlines them too. Each
  transformer block of the step compiled whole (compiled_blocks.py, not served) measured 0.89-0.97x
  of eager per call on an H100; compiling the step whole would fuse more, but on the same H100 its
  first graph had not finished compiling after 7 minutes, and one stream's calls need three
  (docs/model.md §8.7).

Inductor runs here without CUDA graphs of its own: the graphs of graphs.py and incremental_graphs.py
capture the compiled kernels. Results match eager within float rounding.
"""

import functools
import os
from pathlib import Path

import torch

from cosyapp.engine.token2wav import turns
from cosyapp.engine.token2wav.compiling import Deferred
from cosyapp.models.flow_estimator import CausalBlock1D, CausalConditionalDecoder, TransformerBlock
from cosyapp.models.hift import HiFTGenerator, Snake, snake

PIECES = ((TransformerBlock, "after_attention"), (CausalBlock1D, "finish"))


@functools.cache
def _compiled(cls: type, name: str, mode: str | None):
    return turns.compile(getattr(cls, name), mode)


def fuse_estimator(
    estimator: CausalConditionalDecoder,
    cache_dir: Path | None = None,
    mode: str | None = None,
    background: bool = False,
) -> None:
    """Run ``estimator``'s forward, and its memory-bound pieces where the incremental flow calls
    them, through compiled versions, in place (see the module docstring).

    cache_dir: where inductor keeps compiled kernels, so a restart reuses them; a
    TORCHINDUCTOR_CACHE_DIR set by the user wins. Compiling happens on the first call of each piece
    and of each attention mode of the forward (the start-up warm-up meets them all): on the calling
    thread, or with ``background`` on the compile thread while those calls run eagerly
    (compiling.py; the engine's way). mode: torch.compile's (None: its default);
    "max-autotune-no-cudagraphs" also times Triton templates for the matrix products, with the
    pointwise work after them fused in, and picks them where they beat the library's (measured on
    the whole forward: faster at 23 clips, slower at 64, and 335 s of compiling;
    docs/benchmarks/README.md).
    """
    if cache_dir is not None:
        use_cache_dir(cache_dir)
    for module in estimator.modules():
        for cls, name in PIECES:
            if isinstance(module, cls):
                piece = _deferred(cls, name, mode) if background else _compiled(cls, name, mode)
                # An instance attribute shadows the class's method for this module only.
                setattr(module, name, functools.partial(piece, module))
    # An instance attribute again: nn.Module's call runs it in place of the class's forward.
    eager = type(estimator).forward.__get__(estimator)
    compiled = functools.partial(_contiguous_call, turns.compile(eager, mode))
    estimator.forward = Deferred("the flow estimator", eager, compiled) if background else compiled


@functools.cache
def _deferred(cls: type, name: str, mode: str | None) -> Deferred:
    return Deferred(f"{cls.__name__}.{name}", getattr(cls, name), _compiled(cls, name, mode))


def is_compiled(estimator: CausalConditionalDecoder) -> bool:
    """Whether fuse_estimator compiled ``estimator`` (its forward is then an instance attribute)."""
    return "forward" in vars(estimator)


def in_background(estimator: CausalConditionalDecoder) -> bool:
    """Whether fuse_estimator compiles ``estimator`` on the compile thread (compiling.py)."""
    return isinstance(vars(estimator).get("forward"), Deferred)


def compile_unmasked(estimator: CausalConditionalDecoder, blank: tuple[torch.Tensor, ...]) -> None:
    """If fuse_estimator compiled ``estimator``: compile its forward's attention mode without a mask
    (whole clips past the CUDA graphs' buckets, every item the same length), which no bucket's
    capture meets, by one call on ``blank`` (x, mask, mu, t, spks, cond of two rows, the mask all
    ones)."""
    if is_compiled(estimator):
        estimator(*blank, streaming=False, all_valid=True)


def _contiguous_call(compiled, *args, **kwargs) -> torch.Tensor:
    """The compiled forward on contiguous tensors: its graphs are specialised on the inputs' strides,
    and the flow passes the times expanded (stride 0) where the CUDA graphs' buckets pass copies."""
    return compiled(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)


def fuse_hift(
    hift: HiFTGenerator, cache_dir: Path | None = None, mode: str | None = None, background: bool = False
) -> None:
    """Run each of ``hift``'s Snake activations as one compiled kernel, in place.

    A Snake is x + sin(alpha x)^2 / alpha: eager, five kernels that each read and write the whole
    (B, C, T) activation, at up to 120 samples per mel frame; HiFT runs 72 of them per call. Compiled
    with dynamic shapes, one graph serves every Snake of every stage (channels, length and batch
    vary; alpha goes in as a plain tensor, as a parameter's shape would be fixed per graph), and one
    more batch-1 calls; the convolutions stay as they are. Results match eager within float
    rounding (the compiled sine is not bit for bit the eager one). cache_dir, mode, background: as
    ``fuse_estimator`` (the engine compiles in the background: a compile on the HiFT thread would
    also wait for the flow's, which hold dynamo's one compile lock for minutes).
    """
    if cache_dir is not None:
        use_cache_dir(cache_dir)
    compiled = _deferred_snake(mode) if background else _compiled_snake(mode)
    for module in hift.modules():
        if isinstance(module, Snake):
            module.forward = functools.partial(_snake_with, compiled, module)


@functools.cache
def _compiled_snake(mode: str | None):
    return turns.compile(snake, mode)


@functools.cache
def _deferred_snake(mode: str | None) -> Deferred:
    return Deferred("HiFT's Snake", snake, _compiled_snake(mode), family="hift")


def _snake_with(compiled, module: Snake, x: torch.Tensor) -> torch.Tensor:
    return compiled(x, module.alpha.detach())


def use_cache_dir(folder: Path) -> None:
    """Point inductor's cache at ``folder`` unless the user chose one. Importing torch._dynamo writes
    inductor's default into TORCHINDUCTOR_CACHE_DIR, so only another value is the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
