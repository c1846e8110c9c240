"""How the incremental flow writes its caches (incremental.py): eagerly as 8-byte words where the
rows allow, and when a step or a block is compiled through ops that say what they mutate."""

import torch
from torch import Tensor


# Compiled, the caches are written through these ops: an indexed write into a graph input would be
# turned into a copy of the whole input (the pool: gigabytes) with the write applied; an op that
# says it mutates its argument is run in place.
@torch.library.custom_op("cosyapp::put_tails", mutates_args=("tails",))
def put_tails(tails: Tensor, step: Tensor, lo: int, hi: int, kept: Tensor) -> None:
    tails[step, :, lo:hi] = kept.unsqueeze(0)


@put_tails.register_fake
def _(tails: Tensor, step: Tensor, lo: int, hi: int, kept: Tensor) -> None:
    return None


@torch.library.custom_op("cosyapp::put_rows", mutates_args=("kv",))
def put_rows(kv: Tensor, rows: Tensor, step: Tensor, pages: Tensor) -> None:
    """kv (blocks, rows, steps, page, *frame): ``pages`` into rows ``rows`` of the pool's first two
    axes taken as one, at Euler step ``step`` (1,). The block is then part of the rows, a tensor, so
    one compiled graph serves every block (compiled_blocks.py)."""
    kv.flatten(0, 1)[rows, step] = pages


@put_rows.register_fake
def _(kv: Tensor, rows: Tensor, step: Tensor, pages: Tensor) -> None:
    return None


def as_words(t: Tensor) -> Tensor:
    """``t`` seen as 8-byte words along its last axis where its rows allow: the same bytes, which an
    indexed write then moves 8 at a time instead of one element (2 bytes in fp16) at a time."""
    ratio = 8 // t.element_size()
    if ratio < 2 or t.size(-1) % ratio or t.stride(-1) != 1 or t.storage_offset() % ratio:
        return t
    if any(stride % ratio for stride in t.stride()[:-1]):
        return t
    return t.view(torch.int64)
