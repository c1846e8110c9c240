"""When the token2wav worker holds the LM's decode steps (``--lm-yield-ms``; the gate: engine/lm/gate.py).

A step that makes some stream's first chunk holds the LM from its flow call until that step's audio
is out (HiFT done), so the flow and HiFT have the GPU without the LM's time slices in between; the
worker's next flow step waits for that audio too (worker.py), so HiFT does not share the GPU with a
flow call either (at 64 streams on an H100 the first chunk's HiFT took 500-544 ms to launch beside
the next step's flow call and the LM's steps, against 99 ms for a call of 64 alone). The
hold costs the LM that time, and every stream's next chunk comes that much later, so it is bounded
twice: by ``max_s``, and by the slack of the streams already playing, the least audio any of them
has left beyond ``RESERVE_S`` (what its next chunk may still need once the LM goes on: the chunk's
tokens, a flow call and HiFT). No stream plays yet: the hold is ``max_s``. Too little slack left for
``MIN_HOLD_S``: no hold, the step shares the GPU as before.
"""

import threading
import time
from dataclasses import dataclass, field

from cosyapp.engine.lm.gate import LmGate
from cosyapp.engine.token2wav.stream import Job, Stream

RESERVE_S = 1.0
MIN_HOLD_S = 0.02


@dataclass
class Hold:
    gate_hold: int
    started: float
    until: float  # its end at the latest (monotonic)
    done: threading.Event = field(default_factory=threading.Event)  # set once it is released


class LmYield:
    """The worker's holds on the LM: ``hold`` before a step's flow, ``release`` after its HiFT.

    Streams are registered as they open (on the event loop) and forgotten once they end; the flow
    thread reads them, so the set is guarded."""

    def __init__(self, gate: LmGate, max_s: float):
        self.gate, self.max_s = gate, max_s
        self._streams: set[Stream] = set()
        self._lock = threading.Lock()
        self.holds = 0
        self.held_seconds = 0.0

    def add(self, stream: Stream) -> None:
        if stream.streaming:
            with self._lock:
                self._streams.add(stream)

    def hold(self, jobs: list[Job]) -> Hold | None:
        """Hold the LM for ``jobs``' step if it makes a first chunk and the playing streams' slack
        allows (module docstring); None: no hold."""
        if not any(job.streaming and job.offset == 0 for job in jobs):
            return None
        now = time.monotonic()
        seconds = min(self.max_s, self.slack(now) - RESERVE_S)
        if seconds < MIN_HOLD_S:
            return None
        self.holds += 1
        return Hold(self.gate.hold(now + seconds), now, now + seconds)

    def release(self, hold: Hold) -> None:
        self.gate.release(hold.gate_hold)
        self.held_seconds += time.monotonic() - hold.started
        hold.done.set()

    def counters(self) -> dict:
        """Token2WavStats fields: holds, their seconds, and the seconds the LM waited in them."""
        waited, _ = self.gate.waited
        return {"lm_holds": self.holds, "lm_hold_seconds": self.held_seconds, "lm_waited_seconds": waited}

    def slack(self, now: float) -> float:
        """The least audio left to play of the live streams that play (inf: none plays)."""
        with self._lock:
            self._streams = {s for s in self._streams if s.live}
            dry = [s.dry_at for s in self._streams if s.dry_at is not None]
        return min((at - now for at in dry), default=float("inf"))
