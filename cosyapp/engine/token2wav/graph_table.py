"""The CUDA graphs of the flow and HiFT by key (graphs.py, incremental_graphs.py, hift_graphs.py):
each a ``Captured`` with the compiled functions' kinds its capture ran eagerly (compiling.py),
captured again once stale, and the replaced graph freed once no replay can use it (``GraphTable``)."""

import threading
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from cosyapp.engine.token2wav.compiling import compiled_since


@dataclass(kw_only=True)
class Captured:
    """What a GraphTable holds: its subclass's ``graph`` (a CUDA graph, or None where the call runs
    eagerly) and the compiled functions' kinds its capture ran eagerly (``noting_eager_kinds``; a
    compile that ends during the capture leaves the graph stale)."""

    eager: frozenset = frozenset()
    # A CUDA graph's: recorded after each replay, on the stream it ran on (GraphTable frees by it).
    ended: "torch.cuda.Event | None" = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(getattr(self, "graph", None), torch.cuda.CUDAGraph):
            self.ended = torch.cuda.Event()

    @property
    def stale(self) -> bool:
        """It replays eager kernels of a call that runs compiled now."""
        return compiled_since(self.eager)

    def replay(self) -> None:
        self.graph.replay()
        if self.ended is not None:
            self.ended.record()


C = TypeVar("C", bound=Captured)


class GraphTable(Generic[C]):
    """An owner's captured graphs by key (graphs.py, hift_graphs.py, incremental_graphs.py). A graph
    is captured again once stale (``Captured.stale``, ``GraphTable.stale``), on whichever thread its owner
    captures, and ``put`` in place of the old one, which is freed once no replay can use it.

    One thread at a time serves the owner's calls, on a CUDA stream of its own (worker.py): it finds
    each graph it replays by a ``lookup`` (a graph it has just captured too) and replays it before
    its next lookup. Lookups and puts hold one lock: a lookup is wholly before a put, and may find
    the old graph, or wholly after it, and finds the new one. So a replaced graph that a lookup found
    is safe to free once (1) a later lookup has started: the serving thread has launched every
    replay of it, and none will find it again; and (2) its ``ended`` event has passed: its last
    replay, and with it every earlier one on that stream, has finished on the GPU, so no kernel
    reads its memory any more (its outputs' blocks go back to the shared pool, where a later capture
    may take them). Lookups free such graphs, as (1) holds then. A replaced graph no lookup found is
    freed at once. At most one replaced graph per key stays: when another replaces the one that
    replaced it, which a lookup found after the put (else it goes at once), (1) holds for the older,
    and the putting thread waits for its event."""

    def __init__(self):
        self._lock = threading.Lock()
        self._graphs: dict[Hashable, C] = {}
        self._found: set[Hashable] = set()  # keys whose graph a lookup has found since its put
        self._retired: dict[Hashable, C] = {}  # replaced, found by a lookup, maybe still replaying

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __iter__(self) -> Iterator[Hashable]:
        return iter([key for key, _ in self.items()])

    def __getitem__(self, key: Hashable) -> C:
        return self._graphs[key]

    def items(self) -> list[tuple[Hashable, C]]:
        with self._lock:
            return list(self._graphs.items())

    @property
    def retired(self) -> int:
        """Replaced graphs not freed yet."""
        return len(self._retired)

    def lookup(self, key: Hashable) -> C | None:
        """The graph a call of ``key`` replays, or None where none is captured. The serving thread's
        only way to a graph; it frees the replaced graphs whose last replay has ended."""
        with self._lock:
            if self._retired:
                for old in [k for k, g in self._retired.items() if g.ended is None or g.ended.query()]:
                    del self._retired[old]
            graph = self._graphs.get(key)
            if graph is not None:
                self._found.add(key)
            return graph

    def stale(self) -> list[tuple[Hashable, C]]:
        """The stale graphs, to capture again."""
        return [(key, graph) for key, graph in self.items() if graph.stale]

    def put(self, key: Hashable, graph: C) -> None:
        """``graph`` in place of ``key``'s, if any: that one is kept while a replay may use it."""
        older = None
        with self._lock:
            old = self._graphs.get(key)
            self._graphs[key] = graph
            if old is not None and key in self._found:
                self._found.discard(key)
                older = self._retired.pop(key, None)
                self._retired[key] = old
        if older is not None and older.ended is not None:
            older.ended.synchronize()  # its last replay, launched before a lookup found ``old``

    def clear(self) -> None:
        """Drop every graph (their owner is stopped for good: none replays any more)."""
        with self._lock:
            self._graphs.clear()
            self._found.clear()
            self._retired.clear()
