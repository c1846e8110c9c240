"""torch.compile off the serving threads: ``--compile-flow``'s graphs compiled on a thread of their own.

Compiled from an empty cache, the estimator's forward takes about 140 s per attention mode on an H100
(docs/benchmarks/README.md, "Compiling the flow"), and a first call compiles on the thread that
makes it: the flow thread, or the start before it. Here each compiled function is a ``Deferred``: a
call whose kind (its arguments' dtypes and ranks, the sizes dynamo specialises, the flags, the
autocast and inference-mode state) has no compiled graph yet runs the eager function, as
``--compile-flow`` off would, and the first such call hands a copy of its arguments to the compile
thread, which calls the compiled function on them. Once that has returned, calls of that kind run
compiled. So a server starts and serves at once, eagerly, and its flow turns compiled within
minutes; from inductor's cache (kept under the serving cache folder) within seconds.

The CUDA graphs of the flow and HiFT (graphs.py, incremental_graphs.py, hift_graphs.py) replay what
their capture ran. Each is kept in a ``GraphTable`` (graph_table.py) as a ``Captured`` with the
kinds of compiled functions its capture ran eagerly (``noting_eager_kinds``); once one of them is
compiled, the graph is stale: its owner captures it again (a hook, or the next call that meets it),
in place of the old, which serves until then and is freed once no replay can use it, so the graphs
replay compiled kernels. A compile leaves every graph that did not run its kind as it is. (Before,
any compile made every graph stale: in an H100 engine run with ``--compile-flow`` the 124 whole-clip
graphs were captured three times and the incremental buckets twice while the compile thread met one
kind after another, docs/benchmarks/README.md.) When the compile thread's queue runs dry after
compiling, the epoch of the compiled functions' family moves on and it calls that family's
registered hooks: the flow's graphs call only the flow's compiled functions and HiFT's only HiFT's
Snake, so only their owner looks for stale graphs.

Dynamo's hooks are per thread: the serving threads' eager calls of a function are not traced while
the compile thread compiles it, and the compiled graph then serves every copy of the module
(tests/test_compiling.py).
"""

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._dynamo.callback
from torch import Tensor

from cosyapp.engine.cuda_streams import role_stream
from cosyapp.engine.token2wav.turns import COMPILE_THREAD as THREAD
from cosyapp.engine.token2wav.turns import TURNS, on_compile_thread

log = logging.getLogger(__name__)


def kind(args: tuple, kwargs: dict) -> tuple:
    """What tells one compiled graph of a ``dynamic=True`` compile from another, as far as the call
    shows it: each tensor's dtype, device, rank, sizes of 0 and 1 (specialised), contiguity, order
    of strides, whether it is an inference tensor and requires grad; which sizes equal which; each
    module's type; the plain values; the autocast and grad state of the tensors' device. Written
    for speed: every call of a compiled function pays for it (hundreds per incremental flow call)."""
    sizes: list[int] = []
    described = [_describe(a, sizes) for a in args]
    named = [(k, _describe(v, sizes)) for k, v in kwargs.items()]
    # The first tensor's device type: a tensor's description is the one tuple, its device second.
    for d in described:
        if type(d) is tuple:
            device = d[1]
            break
    else:
        device = next((d[1] for _, d in named if type(d) is tuple), "cpu")
    # Dynamo gives sizes that are equal one symbol and guards on that (duck sizing): which sizes past
    # 1 equal which is part of the kind (the incremental step's reads and writes have equal lengths
    # when a stream has no past pages yet), with those of 0 and 1. Each size as 0 -> -2, 1 -> -1, and
    # the others numbered from 2 in the order they first come in.
    first = {0: -2, 1: -1}
    equal = tuple([first.setdefault(s, len(first)) for s in sizes])
    autocast = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    state = (device, *autocast, torch.is_inference_mode_enabled(), torch.is_grad_enabled())
    return (*described, *sorted(named), equal, state)


_PLAIN = (bool, int, float, str, type(None))


def _describe(a, sizes: list[int]) -> object:
    """A plain value as it is; a tensor as a tuple, its sizes added to ``sizes``; anything else (a
    module) by its type, which no other kind of object has. A tensor's order of strides (ties in
    axis order: the layout, up to gaps) is its rank alone where they never increase (contiguous,
    and most views), as sorting takes longer."""
    if not isinstance(a, Tensor):
        return a if isinstance(a, _PLAIN) else type(a)
    shape, strides = a.shape, a.stride()
    sizes += shape
    if len(strides) < 2 or list(strides) == sorted(strides, reverse=True):
        order = len(strides)
    else:  # sorted by stride, largest first; reverse keeps ties in axis order
        order = tuple(sorted(range(len(strides)), key=strides.__getitem__, reverse=True))
    device = "cuda" if a.is_cuda else "cpu" if a.is_cpu else a.device.type  # .device takes longer
    return (a.dtype, device, order, a.is_contiguous(), a.is_inference(), a.requires_grad)


def clone_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with every tensor copied, strides and all (same_strides); modules and values as
    they are."""

    def copy(a):
        return same_strides(a) if isinstance(a, Tensor) else a

    return tuple(map(copy, args)), {k: copy(v) for k, v in kwargs.items()}


def same_strides(t: Tensor) -> Tensor:
    """A copy of ``t`` with its strides, gaps and broadcast (stride 0) axes included, an inference
    tensor where ``t`` is one: compiled on a copy otherwise, dynamo would compile a graph whose
    guards the serving calls then fail (``clone`` makes a slice with gaps contiguous)."""
    broadcast = [d for d in range(t.dim()) if t.stride(d) == 0 and t.size(d) > 1]
    if broadcast:
        base = t[tuple(slice(0, 1) if d in broadcast else slice(None) for d in range(t.dim()))]
        return same_strides(base).expand(t.shape)
    # An inference tensor or not, as ``t`` (dynamo's guards tell them apart).
    with torch.inference_mode(t.is_inference()):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class Deferred:
    """``compiled`` where a call of the same kind has been compiled on the compile thread, else
    ``eager``, the first call of each kind handing ``copy_args(args, kwargs)`` to that thread (not
    while a CUDA graph is being captured: the copies would only be recorded). ``copy_args`` must give
    arguments whose compiled call changes nothing a serving call reads (clone_args, or see
    compiled_blocks.py for a call that writes the page pool)."""

    def __init__(self, name: str, eager: Callable, compiled: Callable, copy_args=clone_args, family="flow"):
        self.name, self.eager, self.compiled, self.copy_args = name, eager, compiled, copy_args
        self.family = family  # the graphs that call it (module docstring)
        self.ready: set[tuple] = set()
        self.pending: set[tuple] = set()
        self.failed: set[tuple] = set()

    def __call__(self, *args, **kwargs):
        # Traced inside another compiled function: inline the eager one. (is_compiling would not do:
        # it also answers True on every thread while any thread compiles.)
        if torch.compiler.is_dynamo_compiling():
            return self.eager(*args, **kwargs)
        key = kind(args, kwargs)
        if key in self.ready:
            return self.compiled(*args, **kwargs)
        noted = getattr(_noting, "kinds", None)
        if noted is not None:  # a graph captured now is stale once this kind is compiled
            noted.add((self, key))
        if key not in self.pending and key not in self.failed and not _capturing():
            try:
                request = _Request(self, key, *self.copy_args(args, kwargs))
            except Exception:  # out of memory for the copy, say: this kind stays eager, the call goes on
                self.failed.add(key)
                log.exception("copying a call of %s for the compile thread failed; it stays eager", self.name)
            else:
                self.pending.add(key)
                COMPILER.submit(request)
        return self.eager(*args, **kwargs)


_noting = threading.local()


@contextlib.contextmanager
def noting_eager_kinds():
    """Within it on this thread, each compiled function's kinds that run eagerly go into the set it
    gives, as ``(Deferred, kind)``: a CUDA graph captured within replays those eager kernels until it
    is captured again once one of them is compiled (``compiled_since``)."""
    outer = getattr(_noting, "kinds", None)
    kinds: set[tuple[Deferred, tuple]] = set()
    _noting.kinds = kinds
    try:
        yield kinds
    finally:
        _noting.kinds = outer
        if outer is not None:
            outer |= kinds


def compiled_since(kinds) -> bool:
    """Whether any of ``kinds`` (from ``noting_eager_kinds``) runs compiled now."""
    return any(key in fn.ready for fn, key in kinds)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass
class _Request:
    fn: Deferred
    key: tuple
    args: tuple
    kwargs: dict
    autocast: tuple = field(init=False)
    modes: tuple = field(init=False)
    copied: object = field(init=False)  # a CUDA event the copies end at, or None

    def __post_init__(self):
        device = self.key[-1][0]
        self.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self.modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        self.copied = None
        if device == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()


class _CompileThread:
    """The process's compile thread (started by the first request), its epoch and recapture hooks."""

    def __init__(self):
        self._queue: queue.Queue[_Request] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._outstanding = 0  # requests submitted and not yet done, their recaptures included
        self._hooks: list[tuple[weakref.WeakMethod, str]] = []  # (hook, family)
        self.epochs: Counter[str] = Counter()  # per family (module docstring)
        self.compiled = 0  # kinds compiled, failures included
        self.elsewhere = 0  # compiles dynamo started on other threads since this thread started
        self.seconds = 0.0
        self._holds = 0  # ``held`` blocks in progress: requests queue until none is left
        self._open = threading.Event()
        self._open.set()

    @contextlib.contextmanager
    def held(self):
        """Requests made inside wait in the queue until every ``held`` block has ended: a server's
        start (Pipeline.start) captures its graphs and warms up at full speed, then compiles while
        it serves. Beside dynamo's tracing, which holds the interpreter lock for minutes, the start's
        eager captures were starved: on an H100 the 124 flow graphs took 94 s instead of 17 from a
        warm inductor cache, and from an empty one the start outlasted a 240 s call."""
        with self._lock:
            self._holds += 1
            self._open.clear()
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                if self._holds == 0:
                    self._open.set()

    def submit(self, request: _Request) -> None:
        with self._lock:
            self._outstanding += 1
            if self._thread is None:
                torch._dynamo.callback.on_compile_start(self._note_compile)
                self._thread = threading.Thread(target=self._run, name=THREAD, daemon=True)
                self._thread.start()
        self._queue.put(request)

    def _note_compile(self, _) -> None:
        """Dynamo starts a compile: on another thread, a call's kind missed a guard of its graph
        (a serving thread then waits for the compile), or something else compiles there."""
        if not on_compile_thread():
            self.elsewhere += 1
            log.warning("dynamo compiles on %s, not on the compile thread", threading.current_thread().name)

    def on_epoch(self, hook: Callable[[int], None], family: str = "flow") -> None:
        """Call the bound method ``hook(epoch)`` on the compile thread each time ``family``'s epoch
        moves on, for as long as its object lives."""
        with self._lock:
            live = [(h, f) for h, f in self._hooks if h() is not None]
            self._hooks = [*live, (weakref.WeakMethod(hook), family)]

    @property
    def outstanding(self) -> int:
        """Compile requests submitted and not yet done (their recaptures included)."""
        return self._outstanding

    @property
    def settled(self) -> bool:
        """No compile waiting or running, and the graphs recaptured after the last one."""
        return self._outstanding == 0

    def counters(self) -> dict:
        """As Token2WavStats fields."""
        return {
            "flow_compiles": self.compiled,
            "flow_compile_seconds": self.seconds,
            "flow_compiling": not self.settled,
            "compiles_elsewhere": self.elsewhere,
        }

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until settled (or ``timeout_s`` passes); returns whether it settled."""
        until = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.settled:
            if until is not None and time.monotonic() > until:
                return False
            time.sleep(0.01)
        return True

    def _run(self) -> None:
        done, families = 0, set()
        while True:
            request = self._queue.get()
            self._open.wait()
            self._compile(request)
            done += 1
            families.add(request.fn.family)
            if self._queue.empty():
                self.epochs.update(families)
                self._recapture(families)
                with self._lock:
                    self._outstanding -= done
                done, families = 0, set()

    def _compile(self, request: _Request) -> None:
        fn, started = request.fn, time.perf_counter()
        device, enabled, dtype = request.autocast
        inference, grad = request.modes
        try:
            with _own_stream(device), torch.inference_mode(inference), torch.set_grad_enabled(grad):
                if request.copied is not None:
                    torch.cuda.current_stream().wait_event(request.copied)
                with torch.autocast(device, dtype=dtype, enabled=enabled):
                    fn.compiled(*request.args, **request.kwargs)
                if device == "cuda":
                    with TURNS.run():  # as the compiled runs (turns.py)
                        torch.cuda.current_stream().synchronize()
            fn.ready.add(request.key)
            log.info("compiled %s in %.1f s (on the compile thread)", fn.name, time.perf_counter() - started)
        except Exception:  # that kind runs eagerly from now on; serving goes on
            fn.failed.add(request.key)
            log.exception("compiling %s failed; its calls of this kind stay eager", fn.name)
        finally:
            fn.pending.discard(request.key)
            self.compiled += 1
            self.seconds += time.perf_counter() - started

    def _recapture(self, families: set[str]) -> None:
        with self._lock:
            hooks = [(h(), f) for h, f in self._hooks if f in families]
        for hook, family in hooks:
            if hook is None:
                continue
            try:
                hook(self.epochs[family])
            except Exception:  # the older graphs serve on
                log.exception("recapturing graphs after a compile failed")


def _own_stream(device: str):
    """A CUDA stream of the compile thread's own on a GPU, so its calls do not wait behind serving."""
    return torch.cuda.stream(role_stream("compile")) if device == "cuda" else contextlib.nullcontext()


COMPILER = _CompileThread()


def epoch(family: str = "flow") -> int:
    """The compile thread's epoch of ``family``: how many times its queue ran dry after compiling
    one of that family's functions."""
    return COMPILER.epochs[family]
