"""A hold on the LM's decode steps while a stream's first audio is being made (``--lm-yield-ms``).

vLLM's engine process and this one take turns on the GPU: without MPS the driver gives each context
time slices, so a flow call made while the LM decodes runs at about half speed (at one stream the
first chunk's flow took 99-107 ms in the engine against ~60 ms alone, at 64 streams 434 against
~230 ms; docs/benchmarks/README.md). The first chunk is what a listener waits for, and while it is
made the LM is usually ahead of every stream that already plays. So the token2wav worker may hold
the LM for a bounded time (yielding.py decides when), and the LM's logits processor, which runs once
per decode step in whichever process steps the engine, waits at the start of its step until the hold
ends.

The hold is one float in a small shared file: the monotonic time until which the LM waits (0: no
hold). ``CLOCK_MONOTONIC`` is one clock for every process of the machine, so the engine process
compares it with its own ``time.monotonic()``. A hold always carries its end, so an LM never waits
longer than that, whatever happens to the process that set it. A second float counts the seconds the
LM waited, a third the steps that waited (written by the waiting side only).
"""

import atexit
import contextlib
import mmap
import os
import struct
import tempfile
import threading
import time
from pathlib import Path

ENV = "COSYAPP_LM_GATE"  # the shared file's path, for the processor in vLLM's engine process
_LAYOUT = struct.Struct("ddd")  # held until (monotonic s; 0 = none), seconds waited, waits
POLL_S = 0.0005  # how often a waiting LM looks whether the hold ended early
MAX_WAIT_S = 2.0  # the longest one step waits, whatever the file says (a torn or stale value)


class LmGate:
    """The holding side, in this process: ``hold`` until a time, ``release`` a hold; holds nest
    (the LM waits until the latest end of the holds still open)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "r+b")  # noqa: SIM115 - mapped for the process's lifetime
        self._map = mmap.mmap(self._file.fileno(), _LAYOUT.size)
        self._lock = threading.Lock()
        self._holds: dict[int, float] = {}
        self._next = 0

    @classmethod
    def create(cls) -> "LmGate":
        """A new gate in a fresh file (in shared memory where the machine has it), removed at exit."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="cosyapp-lm-gate-", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(_LAYOUT.pack(0.0, 0.0, 0.0))
        atexit.register(_remove, Path(name))
        return cls(Path(name))

    def hold(self, until: float) -> int:
        """Hold the LM until monotonic time ``until`` at the latest; returns the hold's id."""
        with self._lock:
            self._next += 1
            self._holds[self._next] = until
            self._write_end()
            return self._next

    def release(self, hold: int) -> None:
        """End hold ``hold`` (idempotent); the LM goes on once no other hold is open."""
        with self._lock:
            self._holds.pop(hold, None)
            self._write_end()

    def _write_end(self) -> None:
        end = max(self._holds.values(), default=0.0)
        struct.pack_into("d", self._map, 0, end)

    @property
    def held_until(self) -> float:
        return _LAYOUT.unpack_from(self._map)[0]

    @property
    def waited(self) -> tuple[float, int]:
        """Seconds the LM has waited in all, and its steps that waited."""
        _, seconds, waits = _LAYOUT.unpack_from(self._map)
        return seconds, int(waits)


class GateWaiter:
    """The waiting side: the LM's logits processor, in the process that steps the engine."""

    def __init__(self, path: Path):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _LAYOUT.size)

    @classmethod
    def from_env(cls) -> "GateWaiter | None":
        """The gate the server made (``ENV``), or None when there is none (or its file is gone)."""
        path = os.environ.get(ENV)
        if not path:
            return None
        try:
            return cls(Path(path))
        except OSError:
            return None

    def wait(self) -> float:
        """Wait while a hold is open, at most until its end (and ``MAX_WAIT_S``); returns the seconds
        waited."""
        start = now = time.monotonic()
        stop = start + MAX_WAIT_S
        while now < min(stop, _LAYOUT.unpack_from(self._map)[0]):
            time.sleep(POLL_S)
            now = time.monotonic()
        if now == start:
            return 0.0
        _, seconds, waits = _LAYOUT.unpack_from(self._map)
        struct.pack_into("dd", self._map, 8, seconds + now - start, waits + 1)
        return now - start


_gate: LmGate | None = None
_gate_lock = threading.Lock()


def process_gate() -> LmGate:
    """This process's gate, made on first use and named in ``ENV`` for the engine processes vLLM
    starts after (they inherit the environment)."""
    global _gate
    with _gate_lock:
        if _gate is None:
            _gate = LmGate.create()
            os.environ[ENV] = str(_gate.path)
        return _gate


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
