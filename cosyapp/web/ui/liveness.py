"""Whole clips whose page has gone stop: no work outlives its client on the page either.

Gradio marks a queued event as no longer alive when its session's event stream disconnects (the tab
was closed or the network dropped), but it never cancels a function that is running. A streaming
event ends at its next chunk (Gradio then closes the generator, which aborts the request); a
whole-clip batch has no such point, so ``ClientWatch`` looks the running batch's events up in
Gradio's queue and cancels the synthesis of each request whose event lost its client.

Gradio offers no public hook for this: the lookup reads its queue's running jobs (``active_jobs``,
lists of events in the order of the batch's values), as ``inputs.isolate_requests`` reads its queue.
"""

import asyncio
from collections.abc import Awaitable
from typing import Any

import gradio as gr

POLL_S = 0.2  # how often a running batch looks at its clients


class ClientWatch:
    """Finds the Gradio events of a running batch and cancels the work of those whose client left."""

    def __init__(self) -> None:
        self._queue: Any = None

    def attach(self, demo: gr.Blocks) -> None:
        """Watch the events of ``demo``'s queue (call once the demo is built)."""
        self._queue = demo._queue

    def batch_events(self, http: gr.Request, size: int) -> list | None:
        """The events of the running batch of ``size`` whose first event is ``http``'s session; None
        when it cannot be told (no queue, or no such batch)."""
        if self._queue is None or http is None or http.session_hash is None:
            return None
        for events in self._queue.active_jobs:
            if events and len(events) == size and events[0].session_hash == http.session_hash:
                return events
        return None

    async def run(self, http: gr.Request, calls: list[Awaitable]) -> list:
        """Await ``calls`` (one per request of the batch, in its order) like ``asyncio.gather`` with
        ``return_exceptions``; a request whose client left is cancelled (its entry: CancelledError)."""
        tasks = [asyncio.ensure_future(call) for call in calls]
        events = self.batch_events(http, len(tasks))
        watcher = asyncio.create_task(_cancel_when_gone(events, tasks)) if events else None
        try:
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if watcher is not None:
                watcher.cancel()


async def _cancel_when_gone(events: list, tasks: list[asyncio.Task]) -> None:
    while not all(task.done() for task in tasks):
        for event, task in zip(events, tasks, strict=True):
            if not event.alive and not task.done():
                task.cancel()
        await asyncio.sleep(POLL_S)
