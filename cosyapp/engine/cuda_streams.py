"""The process's own CUDA streams: one per role (the flow thread, the HiFT thread, the compile
thread, CUDA graph captures, the in-process LM), made once, and never one stream for two roles.

torch hands out its streams round-robin from a pool of 32 per device and priority, so a stream made
with ``torch.cuda.Stream()`` is the same CUDA stream as the one made 32 draws before it. Made anew
for each capture or compile, they came round to the stream a capture ran on: the compile thread then
waited on an event on the stream another thread was capturing (seen on an H100: the capture was
invalidated, and the CPU-to-GPU copies inductor makes as it compiles failed there as "during CUDA
graph capture"). Made once per role and checked against the others, each role's work stays its own.
Libraries that draw from the pool themselves (inductor, vLLM in this process) may still meet one
of these streams; they do not run work on it during a capture of ours.
"""

import threading
from collections.abc import Callable

import torch

POOL_SIZE = 32  # streams per device and priority in torch's pool

_lock = threading.Lock()
_streams: dict[tuple[str, int, int], torch.cuda.Stream] = {}


def role_stream(role: str, device: torch.device | str | None = None, priority: int = 0):
    """The CUDA stream of ``role`` on ``device`` (the current device if None or without an index)
    at ``priority`` (a lower number runs first; torch clamps it to the device's range), made on
    first use."""
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    key = (role, index, priority)
    with _lock:
        if key not in _streams:
            taken = {stream.cuda_stream for stream in _streams.values()}
            _streams[key] = distinct(lambda: torch.cuda.Stream(index, priority=priority), taken)
        return _streams[key]


def distinct(draw: Callable[[], torch.cuda.Stream], taken: set[int]):
    """The first stream ``draw`` gives whose CUDA handle is not ``taken``: the pool comes round within
    POOL_SIZE draws, so more means every stream of it is taken."""
    for _ in range(POOL_SIZE):
        stream = draw()
        if stream.cuda_stream not in taken:
            return stream
    raise RuntimeError(f"every CUDA stream of the pool already has a role ({len(taken)} roles)")
