"""cuda_streams.py: each role's CUDA stream differs from every other role's, although torch hands
streams out round-robin from a pool of 32 (a stream made anew per capture came round to the stream
another thread was capturing on, on an H100). torch's pool is modelled here by the same round-robin
over 32 handles, since the CPU has no CUDA streams."""

import itertools
from dataclasses import dataclass

import pytest

from cosyapp.engine.cuda_streams import POOL_SIZE, distinct


@dataclass(frozen=True)
class Handle:
    cuda_stream: int


def round_robin_pool():
    """A draw as torch's pool makes it: the 32 handles in turn, the first again after the last."""
    handles = itertools.cycle(Handle(0x7000 + i) for i in range(POOL_SIZE))
    return lambda: next(handles)


def test_each_role_gets_a_stream_no_other_role_has_even_after_the_pool_comes_round():
    draw = round_robin_pool()
    taken: set[int] = set()
    roles = []
    for _ in range(5):  # flow, HiFT, compile, capture, the capture thread
        stream = distinct(draw, taken)
        taken.add(stream.cuda_stream)
        roles.append(stream)
        for _ in range(POOL_SIZE - 1):  # others draw from the pool meanwhile: it comes round
            draw()
    assert len({s.cuda_stream for s in roles}) == 5


def test_a_pool_whose_every_stream_has_a_role_is_an_error():
    draw = round_robin_pool()
    taken = {draw().cuda_stream for _ in range(POOL_SIZE)}
    with pytest.raises(RuntimeError, match="every CUDA stream"):
        distinct(draw, taken)
