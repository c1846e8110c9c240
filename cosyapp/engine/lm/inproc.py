"""vLLM's engine core stepped on a thread of this process instead of in a process of its own.

Two processes on one GPU take turns on it: without MPS the driver gives each context time slices,
so the LM's decode steps and the flow's kernels never run at the same moment, and under load each
stage sees the card part time (docs/benchmarks/README.md, "The LM in this process"). In one process
the engine's kernels run on a CUDA stream of their own beside the flow's and HiFT's streams, and the
GPU overlaps them.

``InprocLLM`` offers the part of ``AsyncLLM`` that ``VllmSpeechLM`` uses (``generate``, ``errored``,
``shutdown``, ``model_config``, ``output_processor``) over vLLM's ``LLMEngine`` without
multiprocessing. One thread owns the engine: it builds it, applies the requests added and aborted
from the event loop between steps, steps while any request is unfinished and sleeps otherwise, and
hands each step's outputs to the loops that wait for them.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

import torch

from cosyapp.engine.cuda_streams import role_stream

log = logging.getLogger(__name__)


class InprocEngineError(RuntimeError):
    """The engine thread stopped (a step failed, or it was shut down) while the request waited."""


class InprocLLM:
    """An ``LLMEngine`` stepped on its own thread; build it with ``InprocLLM.start``.

    ``on_idle``: called on the engine thread whenever no request is left unfinished (vLLM records
    scheduler stats only for steps with outputs).
    """

    def __init__(self, on_idle: Callable[[], None] | None = None):
        self.on_idle = on_idle
        self.engine = None  # vllm.v1.engine.llm_engine.LLMEngine, once built
        self.errored = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, engine_args, stat_loggers: list | None = None, **kwargs) -> "InprocLLM":
        """Build the engine from ``engine_args`` (vLLM ``EngineArgs``) on a new thread, which then
        serves it; returns once it serves, or raises what building it raised. Blocks: call it from a
        worker thread."""
        llm = cls(**kwargs)
        ready: concurrent.futures.Future = concurrent.futures.Future()
        llm._thread = threading.Thread(
            target=llm._serve, args=(engine_args, stat_loggers, ready), name="vllm-engine", daemon=True
        )
        llm._thread.start()
        ready.result()
        return llm

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def output_processor(self):
        return self.engine.output_processor

    async def generate(self, prompt, params, request_id: str) -> AsyncIterator:
        """Yield the request's ``RequestOutput``s as the engine makes them; closing the iterator (or
        cancelling its consumer) before the last one aborts the request in the engine."""
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._stopping:
                raise InprocEngineError("the in-process vLLM engine is not serving")
            if request_id in self._waiting:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._waiting[request_id] = (asyncio.get_running_loop(), outputs)
        self._send(("add", request_id, prompt, params))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def shutdown(self) -> None:
        """Stop the engine thread, failing the requests still waiting, and free the engine; idempotent."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _serve(self, engine_args, stat_loggers, ready: concurrent.futures.Future) -> None:
        try:
            self.engine = _build(engine_args, stat_loggers)
        except BaseException as error:
            log.exception("building the in-process vLLM engine failed")
            ready.set_exception(error)  # raised again in start()
            return
        ready.set_result(None)
        stopped = InprocEngineError("the in-process vLLM engine was shut down")
        try:
            with self._cuda_stream():
                self._loop()
        except BaseException as error:
            self.errored = True
            log.exception("the in-process vLLM engine failed")
            stopped = InprocEngineError(f"the in-process vLLM engine failed: {error!r}")
            stopped.__cause__ = error
        finally:
            self._fail_all(stopped)
            with contextlib.suppress(Exception):
                self.engine.engine_core.shutdown()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._apply_commands()
            if not engine.has_unfinished_requests():
                if self.on_idle is not None:
                    self.on_idle()
                self._wake.wait()
                self._wake.clear()
                continue
            self._deliver(engine.step())

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "abort":
                self.engine.abort_request([command[1]])
                continue
            _, request_id, prompt, params = command
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as error:  # a request vLLM rejects fails alone
                log.exception("vLLM rejected request %s", request_id)
                self._deliver_to(request_id, error)

    def _deliver(self, outputs: list) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for output in outputs:
                waiting = self._waiting.get(output.request_id)
                if waiting is not None:
                    by_loop.setdefault(waiting[0], []).append((waiting[1], output))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(_put_all, items)

    def _deliver_to(self, request_id: str, item) -> None:
        with self._lock:
            waiting = self._waiting.get(request_id)
        if waiting is not None:
            with contextlib.suppress(RuntimeError):
                waiting[0].call_soon_threadsafe(waiting[1].put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        """Stop taking requests and fail every one still waiting."""
        with self._lock:
            self._stopping = True
            request_ids = list(self._waiting)
        for request_id in request_ids:
            self._deliver_to(request_id, error)

    def _cuda_stream(self):
        """On a GPU, the engine's steps on a CUDA stream of their own (see the module docstring)."""
        if not torch.cuda.is_available():
            return contextlib.nullcontext()
        return torch.cuda.stream(role_stream("lm"))


def _build(engine_args, stat_loggers):
    """vLLM's LLMEngine for ``engine_args`` with its engine core in this process."""
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    config = engine_args.create_engine_config()
    return LLMEngine(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=not engine_args.disable_log_stats,
        stat_loggers=stat_loggers,
        multiprocess_mode=False,
    )


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, output in items:
        outputs.put_nowait(output)
