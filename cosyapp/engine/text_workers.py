"""The text frontend off the event loop: a request's text and its voice's prompt are prepared in a
worker thread, and wetext's normalisation inside it runs in a worker process.

A text is prepared a block at a time (``TextFrontend.prepare_blocks``): the first block's sentences
and the voice's prompt before the request starts, each later block while the sentences before it
are spoken, one block ahead. A long text thus starts as soon as a short one, and holds the one
text thread for a block at a time, so other requests' first blocks get in between.

Why a process for wetext: its normaliser (a C++ FST search) holds the GIL while it runs, 1.2 s for a
5,000-character English text with numbers on one core of the test machine (about 3 s for Chinese);
in any thread of the serving process it would stall the event loop that drives every stream and
vLLM's output handler (measured: a 10 ms ticker on the loop waited 1.27 s). The rest (rules,
splitting, number spelling, tokenisation) is Python and Rust that lets the loop run between steps.
The process holds only wetext (0.4 s to start), not the tokenizer, whose import pulls in torch. It
runs at a lower priority (nice 10): on a busy machine its CPU goes to the loop and the engines first,
so a long text waits longer rather than every stream stuttering (measured on 2 shared cores: a 10 ms
ticker on the loop lagged 0.23 s at normal priority while a stream played).

One thread: inflect's number speller keeps per-call state on its engine, so two threads must not
share one frontend. One process: the thread waits for each normalisation in turn.
"""

import asyncio
import os
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


class TextWorkers:
    """Prepares texts for the Pipeline without blocking its event loop.

    The thread and the process start on first use (or ``start``); ``close`` stops them and a later
    call starts new ones. The process is spawned, not forked: the serving process runs CUDA and
    engine threads, which a fork would copy half-way.
    """

    def __init__(self, text: TextFrontend):
        self.text = text
        self._frontend = text.with_normalizers(_InProcess(self, "zh"), _InProcess(self, "en"))
        self._thread: ThreadPoolExecutor | None = None
        self._process: ProcessPoolExecutor | None = None

    async def start(self) -> None:
        """Start the thread and the wetext process, so the first request does not wait for them."""
        await self._run(self._frontend.prompt_ids, "1.")

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
        blocks = self._frontend.prepare_blocks(text)
        first, prompt = await self._run(lambda: (_first_sentences(blocks), voice.prompt(self._frontend)))
        return self._sentences(first, blocks), prompt

    async def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids as written (no normalisation), in the text thread, the tokenizer's one
        user."""
        return await self._run(self._frontend.tokenize, text)

    async def _sentences(
        self, first: list[Sentence], blocks: Iterator[list[Sentence]]
    ) -> AsyncGenerator[Sentence, None]:
        ahead = self._run(next, blocks, None)
        try:
            for sentence in first:
                yield sentence
            while (sentences := await ahead) is not None:
                ahead = self._run(next, blocks, None)
                for sentence in sentences:
                    yield sentence
        finally:
            ahead.cancel()  # a block not started is dropped; one in the thread finishes unread

    def _run(self, work, *args) -> asyncio.Future:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="text")
        return asyncio.get_running_loop().run_in_executor(self._thread, work, *args)

    def close(self) -> None:
        """Stop the thread and the process (idempotent)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
        if self._process is not None:
            self._process.shutdown(wait=False, cancel_futures=True)
            self._process = None

    def normalize(self, language: str, text: str) -> str:
        """wetext's ``normalize(text)`` for ``language`` in the worker process (text thread only)."""
        if self._process is None:
            self._process = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_load)
        return self._process.submit(_normalize, language, text).result()


def _first_sentences(blocks: Iterator[list[Sentence]]) -> list[Sentence]:
    """The sentences of the first block that has any; TextError when none has."""
    for sentences in blocks:
        if sentences:
            return sentences
    raise TextError(NOTHING_TO_READ)


@dataclass(frozen=True)
class _InProcess:
    """Stands in for one wetext normalizer in the text thread's frontend."""

    workers: TextWorkers
    language: str

    def normalize(self, text: str) -> str:
        return self.workers.normalize(self.language, text)


def _load() -> None:
    os.nice(10)
    _normalizers["zh"], _normalizers["en"] = wetext_normalizers()


def _normalize(language: str, text: str) -> str:
    return _normalizers[language].normalize(text)  # type: ignore[attr-defined]
