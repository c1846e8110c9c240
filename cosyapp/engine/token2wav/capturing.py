"""The worker's capture thread: CUDA graphs of calls the serving threads met but found no graph for,
captured beside the serving, so that no capture holds a serving thread.

A capture runs its call eagerly a few times and synchronises the device as it begins (turns.py);
under load that is a second or more, in which the thread that met the call would serve nothing.
So a source (the incremental flow's buckets, incremental_graphs.py; HiFT's shapes, hift_graphs.py)
keeps a copy of a missed call's inputs, its calls run eagerly meanwhile, and this thread captures
what each source has waiting, one capture at a time. A source has ``missed`` (how many wait, the
one being captured included) and ``capture_missed()`` (capture one; False when none waits).
"""

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

StreamScope = Callable[[], contextlib.AbstractContextManager]
POLL_S = 0.02  # how often the thread looks for missed calls while none waits


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
