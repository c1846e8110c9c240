"""Admission control: a bounded number of streams at once, granted fairly across clients.

A client is whoever the edge says sent the request (a browser session, a Gradio session, a remote
address). Each client waits in its own queue; a freed stream slot goes to the waiting client with
the fewest streams running, ties to the one served least recently (never served: first). So a
client that sends a hundred requests cannot push the others back: their next request gets the next
free slot. Caps per client (streams running, requests waiting) keep one client from holding the
whole server; past the caps, or past the global waiting limit, a request is refused at once with
``BusyError``.

Requests without a client (in-process callers such as the benchmark) count as a client each.
"""

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager

from cosyapp.errors import BusyError as BusyError  # raised here, shown to the user at the edges


class FairAdmission:
    """Stream slots for requests: ``max_streams`` at once, ``max_waiting`` waiting in all.

    ``max_client_streams`` / ``max_client_waiting`` cap one client (default: half the streams, an
    eighth of the waiting room, at least one each). ``on_reject`` is called for every refusal (a
    metrics counter). All methods run on one event loop.
    """

    def __init__(
        self,
        max_streams: int,
        max_waiting: int,
        max_client_streams: int | None = None,
        max_client_waiting: int | None = None,
        on_reject: Callable[[], None] = lambda: None,
    ):
        self.max_streams = max_streams
        self.max_waiting = max_waiting
        self.max_client_streams = max_client_streams or max(1, max_streams // 2)
        self.max_client_waiting = max_client_waiting or max(1, max_waiting // 8)
        self.on_reject = on_reject
        self._running: dict[Hashable, int] = {}
        self._queues: dict[Hashable, deque[asyncio.Future]] = {}  # each client's waiters, in order
        self._grants = itertools.count()
        self._last_grant: dict[Hashable, int] = {}  # of clients running or waiting only

    @property
    def active(self) -> int:
        """Streams running now."""
        return sum(self._running.values())

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return sum(len(q) for q in self._queues.values())

    def room(self, client: Hashable | None) -> int:
        """Streams ``client`` could start now without waiting: the slots free beyond the requests
        already waiting, at most what its own cap leaves it. What a group of requests from one
        client (the page's compare) checks before it starts, so it runs whole or not at all."""
        free = self.max_streams - self.active - self.waiting
        running = 0 if client is None else self._running.get(client, 0)
        return max(0, min(free, self.max_client_streams - running))

    def clients(self) -> int:
        """Clients with a stream running or a request waiting."""
        return len(self._running.keys() | self._queues.keys())

    @asynccontextmanager
    async def slot(self, client: Hashable | None) -> AsyncIterator[None]:
        """Hold one stream slot for ``client`` while the block runs.

        Raises ``BusyError`` when the request would have to wait and the waiting room (global, or
        this client's share) is full.
        """
        key = object() if client is None else client
        granted = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, deque()).append(granted)
        self._dispatch()
        if not granted.done() and self._over_limits(key):
            self._withdraw(key, granted)
            self.on_reject()
            raise BusyError(
                f"the server is busy ({self.active} of {self.max_streams} streams running, "
                f"{self.waiting} requests waiting); try again in a moment"
            )
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted just as it was cancelled
                self._release(key)
            else:
                self._withdraw(key, granted)
            raise
        try:
            yield
        finally:
            self._release(key)

    def _over_limits(self, key: Hashable) -> bool:
        return self.waiting > self.max_waiting or len(self._queues[key]) > self.max_client_waiting

    def _dispatch(self) -> None:
        """Grant free slots: fewest running first, then least recently served."""
        while self.active < self.max_streams:
            eligible = [k for k in self._queues if self._running.get(k, 0) < self.max_client_streams]
            if not eligible:
                return
            key = min(eligible, key=lambda k: (self._running.get(k, 0), self._last_grant.get(k, -1)))
            waiter = self._queues[key].popleft()
            if not self._queues[key]:
                del self._queues[key]
            if waiter.done():  # its task was cancelled and has not withdrawn yet
                self._forget(key)
                continue
            self._running[key] = self._running.get(key, 0) + 1
            self._last_grant[key] = next(self._grants)
            waiter.set_result(None)

    def _withdraw(self, key: Hashable, waiter: asyncio.Future) -> None:
        queue = self._queues.get(key, deque())
        if waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[key]
        waiter.cancel()
        self._forget(key)

    def _release(self, key: Hashable) -> None:
        self._running[key] -= 1
        if not self._running[key]:
            del self._running[key]
        self._forget(key)
        self._dispatch()

    def _forget(self, key: Hashable) -> None:
        """Drop what is kept about a client that has nothing running or waiting (bounded memory)."""
        if key not in self._running and key not in self._queues:
            self._last_grant.pop(key, None)
