"""Which pending jobs the token2wav worker runs next: earliest deadline first, in bounded batches.

A listener hears a gap when the audio delivered to its stream runs out, so a streaming job's deadline
is the moment its stream runs dry: the wall time of its first audio plus the seconds of audio
delivered since. A stream's first chunk has no audio yet and its listener is already waiting: its
deadline is when it was submitted. A whole clip's client waits for all of it, so its deadline is its
submission plus ``WHOLE_SLACK_S``: streams about to run dry go first, and no whole clip waits for
ever behind streams, whose deadlines move on as they are served.

A step takes jobs in deadline order while the padded size of the flow call each joins (rows x the
longest job's frames, per flow group) stays within ``step_frames``, ``max_batch`` jobs at most; with
``max_batch_per_call``, ``max_batch`` rows in each flow call instead, so a step of incremental
chunks and last-chunk recomputes may hold ``max_batch`` of each (at 256 streams on an H100 most
flow calls had 21-33 rows with four times the served padded bound: docs/benchmarks/README.md,
thirteenth round). The first job always fits, so a huge job runs in a step of its own instead of
padding a whole batch of small ones to its length, and the next step is never further away than one
bounded call (docs/model.md §8.6). A stream's jobs stay in order: once one is left for a later
step, so are the stream's later jobs. While no
stream streams (none opened, ``open``, is live, and none ended in the last ``WHOLE_GRACE_S``: a
streaming request opens each sentence's stream as the one before ends), only whole clips wait and no
listener hears a gap: a step may then reach ``whole_step_frames``, whose larger calls cost less per
clip; a stream opened meanwhile may wait for one such step.

A stream that has been dry for ``LATE_S`` or more is past helping by a short step: its listener
hears a gap whatever the next call does, and what the flow gets through in the next seconds decides
when every stream plays again. So while the most urgent job is such a stream's, a step may reach
``late_step_frames``: at 256 streams on an H100 the last chunks' full-attention recomputes, about
half of the flow's work, ran in calls of 23 clips, and the compiled forward alone costs 21.8 ms a
clip in calls of 23 against 15.1 in calls of 64 (docs/benchmarks/README.md, "Compiling the flow and
HiFT, measured").

Jobs that become due together reach the queue one by one: at one LM step every stream in lockstep
gets its chunk's last token, and the event loop hands the streams their tokens in turn. A worker
that was idle would take the first job alone and leave the rest waiting a whole flow call (100-120
ms of the time to first audio at 4 to 64 streams on the H200, the ``flow_queue`` stage). So a worker
woken from an empty queue first gathers: it takes its step once no job has come for ``gather_s``,
after at most ``gather_max_s``, or at ``max_batch`` jobs. A worker that finds jobs waiting after a
step takes them at once.

A quiet gap does not tell whether more jobs are on their way. Streams admitted one after another
keep their lead through the sentence: the first stream's chunk comes one LM step (4-17 ms) before
the others', so a 2 ms gap took it alone and the rest waited a whole flow call (batches of 1 and 63
at 64 streams on an H100, the ``flow_queue`` stage 113-133 ms at 4-64 streams). So each stream tells
the queue when its next chunk is as few tokens away as its next arrival of tokens may bring
(``expect``; ``SOON_TOKENS`` at least), and a step, idle or not, waits for the jobs expected at its
first look, up to ``expect_s`` (the quiet gap ends an idle worker's gathering only once they have
come). A stream that submits its job, or ends, is expected no more.

The flow shares the GPU with the LM, whose decode steps make the jobs. A small step costs more per
job than a full one (on an H100 a sentence's chunk calls took 24.5 ms a stream at 16 streams, 16.6
at 64: docs/benchmarks/README.md, "Row buckets"), and while it runs the LM gets a slice of the GPU
only: at 256 streams on an H100 the flow ran 89 % of the time in calls of about 21 jobs, about what
the slowed LM had made meanwhile (docs/model.md §8.6). With
``fill_s`` a step that holds no urgent job waits for more, up to ``fill_s`` or until ``max_batch``
have come. A job is urgent while its listener waits on it or soon will: a first chunk, a whole
clip, or the next job of a stream that runs dry within ``FILL_MARGIN_S`` and has not run dry yet. A
stream already dry is not: its listener hears a gap whatever this step does, and fuller steps leave
the LM more of the GPU, so every stream's next chunk comes sooner.

Every method is thread-safe: the event loop puts jobs, the worker's flow thread takes them.
"""

import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable

from cosyapp.engine.token2wav.stream import Job, Stream

# How long a whole-clip job may wait for streams that are about to run dry.
WHOLE_SLACK_S = 1.0
# The gathering of an idle worker's step (module docstring): a quiet gap ends it, the cap bounds it.
GATHER_MAX_S = 0.02

# How long after a streaming stream has ended steps keep to ``step_frames`` (module docstring).
WHOLE_GRACE_S = 1.0
# A stream this close to running dry makes its job urgent: a filling step waits no more.
FILL_MARGIN_S = 1.0
# A stream dry this long makes its job late: its step may reach ``late_step_frames``.
LATE_S = 1.0

# A job's flow group (the jobs one padded flow call can hold) and the frames it makes that call pad to.
Cost = Callable[[Job], tuple[Hashable, int]]


class JobQueue:
    """Pending jobs of every stream; ``take`` hands the worker its next step's batch."""

    def __init__(
        self,
        max_batch: int,
        step_frames: int,
        cost: Cost,
        gather_s: float = 0.0,
        gather_max_s: float = GATHER_MAX_S,
        expect_s: float = 0.0,
        whole_step_frames: int | None = None,
        whole_grace_s: float = WHOLE_GRACE_S,
        fill_s: float = 0.0,
        late_step_frames: int | None = None,
        max_batch_per_call: bool = False,
    ):
        self.max_batch, self.step_frames, self.cost = max_batch, step_frames, cost
        self.max_batch_per_call = max_batch_per_call
        self.whole_step_frames = whole_step_frames or step_frames
        self.late_step_frames = late_step_frames or step_frames
        self.late_steps = 0  # steps whose bound was late_step_frames (a late job first)
        # Streaming streams opened, until a step finds them ended or they are freed (either counts
        # as an end: ``_bound``).
        self._streaming: dict[int, weakref.ref[Stream]] = {}
        self.whole_grace_s = whole_grace_s
        self._stream_ended_at = -math.inf
        self.gather_s, self.gather_max_s, self.expect_s = gather_s, gather_max_s, expect_s
        self.fill_s = fill_s
        self.fills = 0  # steps that waited to fill (module docstring) ...
        self.fill_seconds = 0.0  # ... and how long in all
        self._jobs: list[Job] = []
        self._expected: set[Stream] = set()  # streams whose next job is a token or two away
        self._changed = threading.Condition()
        self._closed = False
        self._held = False

    def __len__(self) -> int:
        with self._changed:
            return len(self._jobs)

    def open(self, stream: Stream) -> None:
        """A stream begins: while a streaming one is live, steps keep to ``step_frames``."""
        if stream.streaming:
            key = id(stream)
            with self._changed:
                self._streaming[key] = weakref.ref(stream, lambda _: self._ended(key))

    def _ended(self, key: int) -> None:
        self._streaming.pop(key, None)
        self._stream_ended_at = time.monotonic()

    def put(self, job: Job) -> None:
        with self._changed:
            self._jobs.append(job)
            self._expected.discard(job.stream)
            self._changed.notify()

    def expect(self, stream: Stream, soon: bool) -> None:
        """Whether ``stream``'s next job is about to come (module docstring); its ``put`` ends it."""
        with self._changed:
            if soon:
                self._expected.add(stream)
            else:
                self._expected.discard(stream)
                self._changed.notify()

    def counters(self) -> dict:
        """The fills and late steps so far (Token2WavStats)."""
        with self._changed:
            return {"fills": self.fills, "fill_seconds": self.fill_seconds, "late_steps": self.late_steps}

    @property
    def expected(self) -> int:
        with self._changed:
            return len(self._expected)

    def hold(self) -> None:
        """Make ``take`` wait (while a group of jobs meant for one step is put)."""
        with self._changed:
            self._held = True

    def release(self) -> None:
        with self._changed:
            self._held = False
            self._changed.notify()

    def close(self) -> list[Job]:
        """Wake the worker to stop: ``take`` returns None from now on. Returns the jobs left."""
        with self._changed:
            self._closed, self._held = True, False
            left, self._jobs = self._jobs, []
            self._changed.notify()
            return left

    def take(self) -> list[Job] | None:
        """Block until there are jobs (and no hold), then remove and return the next step's batch,
        gathered first (``_gather``: expected jobs, and a quiet gap after idling); None once closed."""
        with self._changed:
            idle, gathered = False, False
            while True:
                if not self._closed and not self._held and self._jobs:
                    if not gathered:
                        gathered = True
                        self._gather(idle)
                        self._fill()
                        continue  # closed or held meanwhile: look again
                    batch, late_bound = self._select()
                    self.late_steps += late_bound
                    taken = set(map(id, batch))
                    self._jobs = [job for job in self._jobs if id(job) not in taken]
                    return batch
                if self._closed:
                    return None
                idle = idle or not self._jobs
                self._changed.wait()

    def _gather(self, idle: bool) -> None:
        """Wait (lock held, released while waiting) for the next step's jobs: until the queue holds
        ``max_batch`` or is closed, or else until the jobs expected at this first look have come (or
        ``expect_s`` has passed) and, woken from idle, no job has come for ``gather_s`` (or
        ``gather_max_s`` has passed). Streams expected only later are not waited for: staggered
        streams keep entering their last tokens, and every step would wait the whole ``expect_s``."""
        start = time.monotonic()
        awaited = set(self._expected) if self.expect_s > 0 else set()

        def expecting(waited: float) -> bool:
            return waited < self.expect_s and not awaited.isdisjoint(self._expected)

        while not self._closed and len(self._jobs) < self.max_batch:
            waited = time.monotonic() - start
            if expecting(waited):
                self._changed.wait(self.expect_s - waited)  # a put or an expectation ended wakes it
                continue
            if not (idle and self.gather_s > 0 and waited < self.gather_max_s):
                return
            count = len(self._jobs)
            self._changed.wait(min(self.gather_s, self.gather_max_s - waited))
            if len(self._jobs) == count and not expecting(time.monotonic() - start):
                return

    def _fill(self) -> None:
        """Wait (lock held, released while waiting) while the step would take every job queued, fewer
        than ``max_batch``, none urgent, up to ``fill_s`` (module docstring)."""
        if self.fill_s <= 0:
            return
        start = time.monotonic()
        while not self._closed and len(self._jobs) < self.max_batch:
            now = time.monotonic()
            left = self.fill_s - (now - start)
            if left <= 0 or any(urgent(job, now) for job in self._jobs):
                break
            if len(self._select()[0]) < len(self._jobs):  # its padded bound is reached: the step is full
                break
            self._changed.wait(left)  # a put wakes it to look again
        waited = time.monotonic() - start
        if waited > 0.001:
            self.fills += 1
            self.fill_seconds += waited

    def _bound(self, first: Job) -> tuple[int, bool]:
        """The step's padded size, and whether it is ``late_step_frames``: that (if larger than
        ``step_frames``) while the most urgent job, ``first``, is late (module docstring);
        ``whole_step_frames`` while no stream streams."""
        is_late = self.late_step_frames > self.step_frames and late(first, time.monotonic())
        step = (self.late_step_frames, True) if is_late else (self.step_frames, False)
        for key, ref in list(self._streaming.items()):
            stream = ref()
            if stream is not None and stream.live:  # its run() ends it, however it ends
                return step
            self._ended(key)
        if time.monotonic() - self._stream_ended_at < self.whole_grace_s:
            return step
        return self.whole_step_frames, False

    def _select(self) -> tuple[list[Job], bool]:
        """The next step's jobs, and whether its bound was ``late_step_frames``."""
        order = sorted(range(len(self._jobs)), key=lambda i: (deadline(self._jobs[i]), i))
        bound, late_bound = self._bound(self._jobs[order[0]])
        batch: list[Job] = []
        groups: dict[Hashable, tuple[int, int]] = {}  # group -> (rows, longest frames)
        left_behind: set[int] = set()  # streams with a job left for a later step
        for i in order:
            job = self._jobs[i]
            if len(batch) == self.max_batch and not self.max_batch_per_call:
                break
            if id(job.stream) in left_behind:
                continue
            group, frames = self.cost(job)
            rows, longest = groups.get(group, (0, 0))
            rows, longest = rows + 1, max(longest, frames)
            if batch and (rows * longest > bound or rows > self.max_batch):
                left_behind.add(id(job.stream))
                continue
            groups[group] = (rows, longest)
            batch.append(job)
        # A stream's jobs leave in submission order, whatever their deadlines' rounding.
        position = {id(job): i for i, job in enumerate(self._jobs)}
        return sorted(batch, key=lambda job: position[id(job)]), late_bound


def deadline(job: Job) -> float:
    """When the job's result is needed (monotonic seconds): see the module docstring."""
    stream = job.stream
    if not stream.streaming:
        return job.submitted_at + WHOLE_SLACK_S
    dry_at = stream.dry_at
    return job.submitted_at if dry_at is None else dry_at


def late(job: Job, now: float) -> bool:
    """Whether ``job``'s stream has been dry for ``LATE_S`` or more (module docstring)."""
    stream = job.stream
    return stream.streaming and stream.dry_at is not None and now - stream.dry_at >= LATE_S


def urgent(job: Job, now: float) -> bool:
    """Whether a filling step must not wait on: see the module docstring."""
    stream = job.stream
    if not stream.streaming or stream.dry_at is None:
        return True
    return now <= stream.dry_at <= now + FILL_MARGIN_S
