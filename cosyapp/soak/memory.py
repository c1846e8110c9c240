"""What a leak grows, sampled at quiet moments: live Python objects, torch tensors, heap in use.

Resident memory (RSS) cannot tell a leak from the allocator: freed memory stays resident while the
allocator keeps it for later, its pools grow in steps, and memory reserved early is counted only
when first touched (on a fresh CI machine, RSS rose 174 MB in the second half of a run that leaked
nothing). So a leak check measures what is in use: the objects the garbage collector tracks, the
tensors among them, and the bytes the C allocator has handed out and not had back (glibc's
``mallinfo2``: torch's and numpy's buffers, Python's larger objects). It warms up first, samples
after each of several waves of work, with nothing in flight, and looks at the median growth from one
sample to the next: a one-off step does not move the median, a leak grows in every wave.
"""

import ctypes
import ctypes.util
import gc
import statistics
from itertools import pairwise


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def rss_kb() -> int:
    """Resident memory of this process, in kB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def heap_kb() -> int:
    """kB the C allocator has handed out and not had back, in every arena and mmap'd block
    (glibc's ``mallinfo2``); RSS where that is not available."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return rss_kb()
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) // 1024


def footprint() -> dict[str, int]:
    """After a full collection: live objects the collector tracks, torch tensors among them, the C
    heap in use and RSS (for the record), in kB."""
    import torch

    gc.collect()
    objects = gc.get_objects()
    sample = {
        "objects": len(objects),
        "tensors": sum(issubclass(type(o), torch.Tensor) for o in objects),
        "heap_kb": heap_kb(),
        "rss_kb": rss_kb(),
    }
    del objects
    return sample


def steady_growth(samples: list[dict[str, int]]) -> dict[str, float]:
    """The median growth of each measure from one sample to the next (needs two samples or more)."""
    assert len(samples) >= 2, samples
    return {key: statistics.median(b[key] - a[key] for a, b in pairwise(samples)) for key in samples[0]}
