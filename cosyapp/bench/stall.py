"""Every thread's stack, printed when a benchmark stops making progress.

GPU time is scarce and a run that hangs (an H100 run on 2026-12-06 made no progress for eight
minutes after out-of-memory errors, and its cause was never seen) otherwise ends at its time limit
with nothing to read. While ``stall_dumps`` is active, each time ``seconds`` pass without a call of
``progress`` (a level measured, a variant's warm-up done), Python's faulthandler writes every
thread's stack to the file given (the run's stderr: scripts/gpu-bench.sh keeps it in bench.log).
"""

import contextlib
import faulthandler
from collections.abc import Iterator
from typing import TextIO

_armed: dict[str, object] = {}  # the active dump's seconds and file


def progress() -> None:
    """Start the stall clock again (no-op outside ``stall_dumps``)."""
    if _armed:
        faulthandler.dump_traceback_later(_armed["seconds"], repeat=True, file=_armed["file"])


@contextlib.contextmanager
def stall_dumps(seconds: float, file: TextIO) -> Iterator[None]:
    """Dump every thread's stack to ``file`` whenever ``seconds`` pass without ``progress()``;
    ``seconds`` 0 turns it off."""
    if seconds <= 0:
        yield
        return
    _armed.update(seconds=seconds, file=file)
    progress()
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        _armed.clear()
