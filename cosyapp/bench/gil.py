"""Which of this process's threads held the interpreter lock during part of a level, from py-spy's
samples of this very process.

Every torch call lets go of the interpreter lock while its C++ runs and takes it back after; a
thread that wants it back waits while another thread runs Python. A HiFT call launches ~1,300
kernels that way, so at 64 streams its launch took 500 ms against 15-25 ms alone while the thread's
CUDA calls summed to 0.17 s in a 4.4 s window (docs/benchmarks/README.md, tenth round): it waited
outside the driver. The level's GPU timeline (timeline.py) tells the CUDA calls; this tells who ran
Python meanwhile.

py-spy reads another process's memory, so the sampler runs it as a child on this process
(``--nonblocking``: it never pauses this process, at the price of a stack now and then read while it
changes) with ``--gil``, which keeps only the stack of the thread holding the lock at each sample.
The share of a thread is its samples over the samples the window should have had (rate x seconds),
so the shares plus the unheld rest make 100 %. Where py-spy is missing or may not read this process,
the summary says so and the level goes on.
"""

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

RATE = 200  # samples a second
TOP = 5  # functions named per thread
OWN = "(cosyapp/"  # a frame of this project's code, as py-spy names its file
# Linux's prctl option that lets any process trace this one (Yama's ptrace_scope 1 allows only a
# process's ancestors, and py-spy is this process's child).
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF)
# A raw line: "thread (ID): NAME;frame;...;frame COUNT" or, for an unnamed thread, "thread (ID);...".
LINE = re.compile(r"^thread \((?P<id>[^)]*)\)(?:: (?P<name>[^;]*))?;(?P<stack>.*) (?P<count>\d+)$")
LINE_NUMBER = re.compile(r":\d+\)$")


class GilSampler:
    """``start`` a window, ``finish`` it (blocking: off the event loop), then ``summary``.

    ``held_only`` False samples every thread at every sample (py-spy's ``--idle`` instead of
    ``--gil``): where each thread spent the window, running or waiting, which tells a thread slow to
    launch its kernels (HiFT's, 400-480 ms at 64 streams on an H200 while the lock was free most of
    the window: docs/benchmarks/README.md, twelfth round) where it was meanwhile."""

    def __init__(self, rate: int = RATE, held_only: bool = True):
        self.rate, self.held_only = rate, held_only
        self._proc: subprocess.Popen | None = None
        self._out: Path | None = None
        self._started = 0.0
        self._seconds = 0.0
        self._error: str | None = None

    def start(self) -> None:
        # on PATH, or beside this interpreter (a virtual environment's bin/ that PATH does not name)
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if spy is None:
            self._error = "py-spy not found"
            return
        with contextlib.suppress(OSError, AttributeError):  # without Yama (or off Linux): nothing to allow
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)
        with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as file:
            self._out = Path(file.name)
        which = "--gil" if self.held_only else "--idle"
        command = [spy, "record", "--pid", str(os.getpid()), which, "--threads", "--nonblocking"]
        command += ["--format", "raw", "--rate", str(self.rate), "--output", str(self._out)]
        self._proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._started = time.perf_counter()

    def stop(self) -> None:
        """End the window now (py-spy stops sampling when interrupted); ``finish`` waits for its file."""
        if self._proc is None or self._seconds:
            return
        self._seconds = time.perf_counter() - self._started
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)

    def finish(self) -> None:
        """End the window if ``stop`` has not, and wait for py-spy to write its file."""
        if self._proc is None:
            return
        self.stop()
        try:
            _, err = self._proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        if self._proc.returncode not in (0, -signal.SIGINT) or not self._out.stat().st_size:
            self._error = f"py-spy ended with {self._proc.returncode}: {err.strip()[-300:]}"
        self._proc = None

    def summary(self) -> dict:
        """The window's lock holders (``holders``), or with ``held_only`` False where every thread was
        (without ``held_share``: every thread is in every sample, so the shares add up past 1), or
        why there are none."""
        try:
            if self._error is not None or self._out is None:
                return {"error": self._error or "not started"}
            held = holders(self._out.read_text(), self.rate * self._seconds)
            if not self.held_only:
                del held["held_share"]
            return held | {"window_s": round(self._seconds, 3)}
        finally:
            if self._out is not None:
                self._out.unlink(missing_ok=True)


def holders(raw: str, expected: float) -> dict:
    """py-spy's raw samples (``--gil`` or ``--idle``, ``--threads --format raw``) summed up per thread:
    the share of the ``expected`` samples it is in (held the lock, or was anywhere), its innermost
    functions then (file, no line), and its innermost frames in this project's code (``own``: file and
    line, so a torch call's caller shows)."""
    threads: dict[str, Counter] = defaultdict(Counter)
    own: dict[str, Counter] = defaultdict(Counter)
    for line in raw.splitlines():
        match = LINE.match(line.strip())
        if match is None:
            continue
        name = match["name"] or f"thread {match['id']}"
        frames = match["stack"].split(";")
        threads[name][LINE_NUMBER.sub(")", frames[-1])] += int(match["count"])
        ours = [frame for frame in frames if OWN in frame]
        if ours:
            own[name][ours[-1]] += int(match["count"])
    expected = max(expected, 1.0)
    held = sum(sum(c.values()) for c in threads.values())
    return {
        "samples": held,
        "expected": round(expected),
        "held_share": round(held / expected, 4),
        "threads": {
            name: {
                "share": round(sum(c.values()) / expected, 4),
                "top": {f: round(n / expected, 4) for f, n in c.most_common(TOP)},
                "own": {f: round(n / expected, 4) for f, n in own[name].most_common(TOP)},
            }
            for name, c in sorted(threads.items(), key=lambda kv: -sum(kv[1].values()))
        },
    }
