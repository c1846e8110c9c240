"""The worker's capture thread: CUDA graphs of calls the serving threads met but found no graph for,
captured beside the serving, so that no capture holds a serving thread.

A capture runs its call eagerly a few times and synchronises the device as it begins (turns.py);
under load that is a second or more, in which the thread that met the call would serve nothing.
So a source (the incremental flow's buckets, incremental_graphs.py; HiFT's shapes, hift_graphs.py)
keeps a copy of a missed call's inputs, its calls run eagerly meanwhile, and this thread captures
what each source has waiting, one capture at a time. A source has ``missed`` (how many wait, the
one being captured included) and ``capture_missed()`` (capture one; False when none waits); both
sources keep their missed calls in a ``MissedCalls``.
"""

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

import torch

StreamScope = Callable[[], contextlib.AbstractContextManager]
POLL_S = 0.02  # how often the thread looks for missed calls while none waits


Inputs = TypeVar("Inputs")


class MissedCalls(Generic[Inputs]):
    """The calls a serving thread met without a graph, for the capture thread: per key (a graph's
    shape) a copy of one call's inputs and the CUDA event its copy ends at; and the keys whose
    capture failed, which run eagerly for good and are kept no more. Thread-safe: the serving
    thread keeps, the capture thread takes."""

    def __init__(self):
        self._kept: dict[Hashable, tuple[Inputs, torch.cuda.Event | None, torch.device]] = {}
        self.failed: set[Hashable] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Keys waiting, the one being captured included."""
        return len(self._kept)

    def keep(self, key: Hashable, copy: Callable[[], Inputs], device: torch.device) -> bool:
        """Keep ``copy()`` (a copy of the call's inputs, made on the current CUDA stream) under ``key``
        unless the key has one waiting or has failed; True when this call kept it."""
        with self._lock:
            if key in self._kept or key in self.failed:
                return False
            inputs = copy()
            copied = None
            if device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record()
            self._kept[key] = (inputs, copied, device)
            return True

    def fail(self, key: Hashable) -> None:
        with self._lock:
            self.failed.add(key)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    @contextlib.contextmanager
    def oldest(self) -> Iterator[tuple[Hashable, Inputs] | None]:
        """The key kept longest and its inputs, with the current CUDA stream made to wait for their
        copy; None when none waits. The key stays waiting until the block ends, however it ends
        (warm-ups wait until none does)."""
        with self._lock:
            oldest = next(iter(self._kept.items()), None)
        if oldest is None:
            yield None
            return
        key, (inputs, copied, device) = oldest
        try:
            if copied is not None:
                torch.cuda.current_stream(device).wait_event(copied)
            yield key, inputs
        finally:
            with self._lock:
                self._kept.pop(key, None)


class Source(Protocol):
    @property
    def missed(self) -> int: ...

    def capture_missed(self) -> bool: ...


class CaptureThread:
    """``start`` the thread (under ``cuda_stream()``, a CUDA stream of its own), ``stop`` it after the
    capture it is in; ``pending`` counts what waits (warm-ups wait until none does)."""

    def __init__(self, sources: Sequence[Source], cuda_stream: StreamScope):
        self.sources = list(sources)
        self.cuda_stream = cuda_stream
        self._thread: threading.Thread | None = None
        self._running = False

    @property
    def pending(self) -> int:
        return sum(source.missed for source in self.sources)

    def start(self) -> None:
        """Idempotent; a thread without sources is not started."""
        if self._thread is not None or not self.sources:
            return
        self._running = True
        self._thread = threading.Thread(target=self._work, name="token2wav-capture", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Idempotent."""
        self._running = False
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        with torch.inference_mode(), self.cuda_stream():
            while self._running:
                # one capture from every source in turn, so a busy one does not starve the others
                captured = [source.capture_missed() for source in self.sources]
                if not any(captured):
                    time.sleep(POLL_S)
