"""The incremental flow's transformer blocks, each run as one graph compiled by torch.compile, one
graph for all 56, where the pool keeps attention inputs (the default). Not served: on an H100 the
step's calls with their blocks compiled took 0.89-0.97x of eager's time (docs/benchmarks/README.md,
"Compiling while serving, on a GPU"), so ``--compile-flow`` compiles the step's pieces (fused.py).
Kept to measure it again (scripts/flow_compile_speed.py, FLOW_CACHE_COMPILE_SCOPE=blocks).

Compiling the incremental step whole fuses everything, but on an H100 its first graph had not
finished compiling after 7 minutes (docs/model.md §8.7); compiling only the pieces the step calls
(fused.py) leaves the attention's input norm, the pool's writes and gathers, the projections'
casts and layouts as eager kernels. Here each block's whole attention over the pool is one compiled
function: the block's module is inlined and its parameters, projection weights, pool rows and Euler
step are inputs, so every block reuses one graph. Only pools of attention inputs (the default) are
supported.
"""

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from cosyapp.engine.token2wav import turns
from cosyapp.engine.token2wav.compiling import Deferred, same_strides
from cosyapp.engine.token2wav.writes import put_rows
from cosyapp.models.flow_estimator import TransformerBlock, autocast_dtype

if TYPE_CHECKING:  # incremental.py calls this module's functions through its estimator
    from cosyapp.engine.token2wav.incremental import IncrementalEstimator, _StepIO


def attend_block(
    block: TransformerBlock,
    h: Tensor,
    q_weight: Tensor,
    kv_weight: Tensor,
    kv: Tensor,
    offset: Tensor,
    step: Tensor,
    write_rows: Tensor,
    read_rows: Tensor,
    attn_mask: Tensor,
) -> Tensor:
    """One transformer block of the incremental step (IncrementalEstimator._attend with a pool of
    attention inputs), h (ROWS*B, W, C): the new frames' normalised inputs go to their pages, the
    past's and the new ones are read back with one gather, and the keys and values are projected
    from them. offset (1,): the block's first row in the pool's rows of all blocks; step (1,)."""
    rb, width, _ = h.shape
    heads = block.attn1.heads
    normed = block.norm1(h)
    normed = normed.to(autocast_dtype(normed.device) or q_weight.dtype)  # as _from_inputs
    q = F.linear(normed, q_weight).view(rb, width, heads, -1).transpose(1, 2)
    page = kv.size(3)
    n_pages = -(-width // page)
    # Up to whole pages, the last new frame again where eager pads zeros: those slots are masked keys
    # and never committed, so the result is the same; a padding (of width 0 at times) would make
    # dynamo compile one graph for widths of whole pages and another for the rest.
    paged = normed[:, torch.arange(n_pages * page, device=h.device).clamp(max=width - 1)]
    put_rows(kv, offset + write_rows, step, paged.reshape(rb * n_pages, page, -1).to(kv.dtype))
    seen = kv.flatten(0, 1)[offset + read_rows, step]  # (ROWS*B*(Pp + Wp), page, C)
    seen = seen.view(rb, -1, seen.size(-1)).to(normed.dtype)
    # The new frames over their pages' slots (the trash page's hold other streams' frames), by
    # position rather than by slices, which can be empty (no past yet; widths of whole pages).
    at = torch.arange(seen.size(1), device=h.device) - (seen.size(1) - n_pages * page)
    fresh = ((at >= 0) & (at < width)).view(1, -1, 1)
    seen = torch.where(fresh, paged[:, at.clamp(min=0)], seen)
    kvp = F.linear(seen, kv_weight).view(rb, seen.size(1), 2, heads, -1)
    keys, values = kvp[:, :, 0].transpose(1, 2), kvp[:, :, 1].transpose(1, 2)
    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask)
    return block.after_attention(h, attended)


@functools.cache
def compiled_attend_block(mode: str | None = None):
    """attend_block compiled with dynamic shapes (one per torch.compile mode)."""
    return turns.compile(attend_block, mode)


def compile_blocks(
    step_fn: "IncrementalEstimator", mode: str | None = None, background: bool = False
) -> None:
    """``step_fn`` runs each transformer block through the compiled attend_block from now on: compiled
    on the calling thread, or with ``background`` on the compile thread (compiling.py), its calls
    running attend_block eagerly until then."""
    if not step_fn.inputs:
        raise ValueError("compiled blocks need a pool of attention inputs")
    block = deferred_attend_block(mode) if background else compiled_attend_block(mode)
    step_fn.attend_block = functools.partial(_run_block, block)


def deferred_attend_block(mode: str | None = None) -> Deferred:
    """attend_block compiled on the compile thread, one per torch.compile mode."""
    return _deferred_attend_block(mode)


@functools.cache
def _deferred_attend_block(mode: str | None) -> Deferred:
    name = "the incremental flow's transformer block"
    return Deferred(name, attend_block, compiled_attend_block(mode), _trash_writes)


def _trash_writes(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """attend_block's arguments for the compile thread: copies, but the page pool itself, written
    at the trash page only (row 0 of each block, whose slots every call masks), so no stream's pages
    change."""
    block, h, q_weight, kv_weight, kv, offset, step, write_rows, read_rows, attn_mask = args
    copies = (h, offset, step, read_rows, attn_mask)
    h, offset, step, read_rows, attn_mask = map(same_strides, copies)
    trash = torch.zeros_like(write_rows)
    return (block, h, q_weight, kv_weight, kv, offset, step, trash, read_rows, attn_mask), kwargs


def _run_block(compiled, step_fn: "IncrementalEstimator", block: TransformerBlock, h: Tensor, io: "_StepIO"):
    """The step's next block through ``compiled``: the Python-side bookkeeping (which block, its
    weights, its rows as a tensor) stays outside the graph, so no guard tells the blocks apart."""
    i, inputs, kv = io.block, io.inputs, io.kv
    io.block += 1
    weights = step_fn.q_weights[i], step_fn.kv_weights[i]
    offset = io.first_row(i)
    return compiled(
        block, h, *weights, kv, offset, io.step_t, inputs.write_rows, inputs.read_rows, inputs.attn_mask
    )
