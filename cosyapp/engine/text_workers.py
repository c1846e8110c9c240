"""The text frontend off the event loop: a request's text and its voice's prompt are prepared in a
worker thread, and wetext's normalisation inside it runs in a worker process.

A text is prepared a block at a time (``TextFrontend.prepare_blocks``): the first block's sentences
and the voice's prompt before the request starts, each later block while the sentences before it
are spoken, one block ahead. A long text thus starts as soon as a short one, and holds its lane's
thread for a block at a time, so other requests' first blocks get in between.

Why a process for wetext: its normaliser (a C++ FST search) holds the GIL while it runs, 1.2 s for a
5,000-character English text with numbers on one core of the test machine (about 3 s for Chinese);
in any thread of the serving process it would stall the event loop that drives every stream and
vLLM's output handler (measured: a 10 ms ticker on the loop waited 1.27 s). The rest (rules,
splitting, number spelling, tokenisation) is Python and Rust that lets the loop run between steps.
The process holds only wetext (0.4 s to start), not the tokenizer, whose import pulls in torch. It
runs at a lower priority (nice 10): on a busy machine its CPU goes to the loop and the engines first,
so a long text waits longer rather than every stream stuttering (measured on 2 shared cores: a 10 ms
ticker on the loop lagged 0.23 s at normal priority while a stream played).

Lanes: one thread with one process is one lane, and a request keeps the lane it started in for all
its blocks. Each lane has its own frontend copy: inflect's number speller keeps per-call state on its
engine, and the tokenizer's settings live on it, so two threads must not share either. A request
starts in the lane with the fewest calls waiting. At 256 requests arriving together one lane made the
time before the LM grow by 1-1.5 ms a request (the ``text`` stage, 242-364 ms median at 256 streams
on an H100, docs/benchmarks/README.md); a GPU host has the cores for a few lanes (``default_lanes``).
"""

import asyncio
import concurrent.futures
import copy
import os
import threading
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import TYPE_CHECKING

from cosyapp.frontend.text import NOTHING_TO_READ, Sentence, TextError, TextFrontend, wetext_normalizers

if TYPE_CHECKING:  # torch-free at import: the worker process imports this module
    from cosyapp.frontend.voices import Voice
    from cosyapp.models.cosyvoice2 import PromptInputs

_normalizers: dict[str, object] = {}  # a worker process's own wetext normalizers, by language
MAX_LANES = 4  # a lane's thread and process each take up to a core while texts arrive


def default_lanes(cores: int | None = None) -> int:
    """Lanes for a host of ``cores`` (None: this one's): one per four cores, 1 to MAX_LANES, so a small
    host keeps its cores for the event loop and the engines."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(MAX_LANES, cores // 4))


class TextWorkers:
    """Prepares texts for the Pipeline without blocking its event loop, in ``lanes`` lanes.

    A lane's thread and process start on first use (or ``start``); ``close`` stops them and a later
    call starts new ones. The processes are spawned, not forked: the serving process runs CUDA and
    engine threads, which a fork would copy half-way.
    """

    def __init__(self, text: TextFrontend, lanes: int = 0):
        """``lanes``: 0 = ``default_lanes()`` (ServeOptions.text_lanes)."""
        self.text = text
        self._lanes = [_Lane(text, i) for i in range(lanes or default_lanes())]

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    async def start(self) -> None:
        """Start every lane's thread and wetext process, so no first request waits for them."""
        await asyncio.gather(*(lane.run(lane.frontend.prompt_ids, "1.") for lane in self._lanes))

    async def prepare(
        self, text: str, voice: "Voice"
    ) -> tuple[AsyncGenerator[Sentence, None], "PromptInputs"]:
        """``text``'s sentences as they are prepared, and ``voice``'s model inputs, off the loop.

        Returns once the first sentences and the prompt are ready; the iterator prepares the rest a
        block ahead (close it to stop). Raises ``TextError`` for unusable text, here for what the
        first block shows (any rule of ``check_text``, nothing to read aloud in the whole text) and
        from the iterator for what a later block shows (a number too long to spell out); raises
        what the voice raises.
        """
        lane = self._least_busy()
        blocks = lane.frontend.prepare_blocks(text)
        first, prompt = await lane.run(lambda: (_first_sentences(blocks), voice.prompt(lane.frontend)))
        return self._sentences(lane, first, blocks), prompt

    async def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids as written (no normalisation), in a lane's thread, its tokenizer's one
        user."""
        lane = self._least_busy()
        return await lane.run(lane.frontend.tokenize, text)

    async def _sentences(
        self, lane: "_Lane", first: list[Sentence], blocks: Iterator[list[Sentence]]
    ) -> AsyncGenerator[Sentence, None]:
        ahead = lane.run(next, blocks, None)
        try:
            for sentence in first:
                yield sentence
            while (sentences := await ahead) is not None:
                ahead = lane.run(next, blocks, None)
                for sentence in sentences:
                    yield sentence
        finally:
            ahead.cancel()  # a block not started is dropped; one in the thread finishes unread

    def _least_busy(self) -> "_Lane":
        return min(self._lanes, key=lambda lane: lane.waiting)

    def close(self) -> None:
        """Stop every lane's thread and process (idempotent)."""
        for lane in self._lanes:
            lane.close()


class _Lane:
    """One text thread, its wetext process and its own frontend (module docstring)."""

    def __init__(self, text: TextFrontend, index: int):
        self.index = index
        self.frontend = text.with_normalizers(_InProcess(self, "zh"), _InProcess(self, "en"))
        if index:  # the first lane keeps the tokenizer; the others get their own
            self.frontend.tokenizer = copy.deepcopy(text.tokenizer)
        self.waiting = 0  # calls submitted to the thread and not finished
        self._lock = threading.Lock()  # the loop raises the count, the thread's callbacks lower it
        self._thread: ThreadPoolExecutor | None = None
        self._process: ProcessPoolExecutor | None = None

    def run(self, work, *args) -> asyncio.Future:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"text-{self.index}")
        with self._lock:
            self.waiting += 1

        def done(call: concurrent.futures.Future) -> None:  # ran, failed, or cancelled before it began
            with self._lock:
                self.waiting -= 1

        call = self._thread.submit(work, *args)
        call.add_done_callback(done)
        return asyncio.wrap_future(call)  # cancelling it cancels a call not yet begun

    def normalize(self, language: str, text: str) -> str:
        """wetext's ``normalize(text)`` for ``language`` in this lane's process (its thread only)."""
        if self._process is None:
            self._process = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_load)
        return self._process.submit(_normalize, language, text).result()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
        if self._process is not None:
            self._process.shutdown(wait=False, cancel_futures=True)
            self._process = None


def _first_sentences(blocks: Iterator[list[Sentence]]) -> list[Sentence]:
    """The sentences of the first block that has any; TextError when none has."""
    for sentences in blocks:
        if sentences:
            return sentences
    raise TextError(NOTHING_TO_READ)


@dataclass(frozen=True)
class _InProcess:
    """Stands in for one wetext normalizer in a lane's frontend."""

    lane: _Lane
    language: str

    def normalize(self, text: str) -> str:
        return self.lane.normalize(self.language, text)


def _load() -> None:
    os.nice(10)
    _normalizers["zh"], _normalizers["en"] = wetext_normalizers()


def _normalize(language: str, text: str) -> str:
    return _normalizers[language].normalize(text)  # type: ignore[attr-defined]
