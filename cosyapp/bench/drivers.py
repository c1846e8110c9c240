"""How the benchmark sends its requests: one driver per way a client reaches cosyapp.

- ``pipeline``: ``Pipeline.stream`` in this process (no HTTP, no UI);
- ``openai``: ``POST /v1/audio/speech`` of a server (raw 16-bit PCM, streamed when streaming);
- ``gradio``: the page's ``/speak`` (streaming) and ``/speak_clip`` (whole clip) through gradio_client,
  one client per concurrent user, as separate browser sessions would be;
- ``browser``: the page itself in headless Chromium (``browser.py``), streaming only.

Each driver sends a level's requests at once and returns what each client saw (``RequestResult``).
The HTTP drivers run their clients in threads, off the event loop that serves the benchmark's own
server and runs the engines. httpx and gradio_client are imported only by those drivers.
"""

import asyncio
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cosyapp.bench.stats import RequestResult, first_chunk_stages
from cosyapp.engine.pipeline import BusyError, Pipeline, SynthesisRequest
from cosyapp.frontend.voices import Voice

DRIVERS = ("pipeline", "openai", "gradio", "browser")
# The page's stats line after each chunk: the audio so far, e.g. "(34,560 samples at 24,000 Hz)". It is
# the one place the endpoints report lengths without downloading the audio.
STATS_SAMPLES = re.compile(r"\(([\d,]+) samples at ([\d,]+) Hz\)")

OnDone = Callable[[], None]


class PipelineDriver:
    """Requests straight to a Pipeline on this event loop."""

    name = "pipeline"

    def __init__(self, pipeline: Pipeline, voice: Voice):
        self.pipeline = pipeline
        self.voice = voice

    async def prepare(self, clients: int) -> None:
        """Nothing to set up."""

    async def send(
        self, text: str, streaming: bool, seeds: list[int], on_done: OnDone
    ) -> list[RequestResult]:
        """One request per seed, all at once; ``on_done`` is called as each ends."""

        async def one(seed: int) -> RequestResult:
            result = await self._request(SynthesisRequest(text, self.voice, seed=seed, streaming=streaming))
            on_done()
            return result

        return list(await asyncio.gather(*(one(seed) for seed in seeds)))

    async def close(self) -> None:
        """Nothing to release."""

    async def _request(self, request: SynthesisRequest) -> RequestResult:
        result = RequestResult()
        start, started = time.perf_counter(), time.monotonic()
        rate = self.pipeline.sample_rate
        try:
            async for chunk in self.pipeline.stream(request):
                result.chunks.append((time.perf_counter() - start, len(chunk.samples) / rate))
                if chunk.times is not None and result.first_chunk is None:  # the first sentence's
                    result.first_chunk = first_chunk_stages(chunk.times, started, time.monotonic())
        except BusyError as e:  # the admission limits: a result of the load, not a failure of the bench
            result.error = f"BusyError: {e}"
        result.total = time.perf_counter() - start
        return result


class OpenAIDriver:
    """``POST /v1/audio/speech`` through httpx, one thread per concurrent request.

    Request i comes from user i: its own address in ``X-Forwarded-For``, which a server trusts from
    loopback as from a reverse proxy, so fair admission sees as many users as requests (as behind a
    proxy; without it, every request would share the stream cap of one address).
    """

    name = "openai"

    def __init__(self, base_url: str, voice_id: str, sample_rate: int):
        import httpx

        self.voice_id = voice_id
        self.sample_rate = sample_rate
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        # A long text at high concurrency can take minutes: no read timeout.
        timeout = httpx.Timeout(30.0, read=None, pool=None)
        self.http = httpx.Client(base_url=base_url, limits=limits, timeout=timeout)
        self.errors = (httpx.HTTPError,)
        self.threads = 0
        self.pool = ThreadPoolExecutor(1)

    async def prepare(self, clients: int) -> None:
        """A thread for each of ``clients`` concurrent requests."""
        if self.threads < clients:
            self.pool.shutdown()
            self.pool = ThreadPoolExecutor(clients, thread_name_prefix="bench-openai")
            self.threads = clients

    async def send(
        self, text: str, streaming: bool, seeds: list[int], on_done: OnDone
    ) -> list[RequestResult]:
        """One request per seed, all at once; ``on_done`` is called as each ends."""
        loop = asyncio.get_running_loop()
        futures = [
            loop.run_in_executor(self.pool, self._request, text, streaming, seed, user)
            for user, seed in enumerate(seeds)
        ]
        for future in futures:
            future.add_done_callback(lambda _: on_done())
        return list(await asyncio.gather(*futures))

    async def close(self) -> None:
        self.pool.shutdown()
        self.http.close()

    def _request(self, text: str, streaming: bool, seed: int, user: int) -> RequestResult:
        body = {"input": text, "voice": self.voice_id, "seed": seed, "stream": streaming}
        body["response_format"] = "pcm"  # raw samples: every byte received is audio
        headers = {"X-Forwarded-For": f"10.0.{user // 250}.{user % 250 + 1}"}
        result = RequestResult()
        received = 0
        start = time.perf_counter()
        try:
            with self.http.stream("POST", "/v1/audio/speech", json=body, headers=headers) as response:
                if response.status_code != 200:
                    response.read()
                    result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                else:
                    for piece in response.iter_raw():
                        samples = (received + len(piece)) // 2 - received // 2
                        received += len(piece)
                        if samples:
                            result.chunks.append((time.perf_counter() - start, samples / self.sample_rate))
        except self.errors as e:
            result.error = f"{type(e).__name__}: {e}"
        result.total = time.perf_counter() - start
        return result


class GradioDriver:
    """The page's endpoints through gradio_client: ``/speak`` streaming, ``/speak_clip`` whole clips.

    Each concurrent request has its own Client (its own session and event stream, as a browser tab),
    made before the level starts and kept for later levels. One thread watches every job: gradio_client
    hands a job its messages by polling every 50 ms, so its arrival times carry up to that delay, as
    they do for any gradio_client user.
    """

    name = "gradio"

    def __init__(self, base_url: str, voice_id: str, poll_s: float = 0.005):
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # gradio_client reads it too
        from gradio_client import Client

        self.make_client = lambda: Client(
            base_url, download_files=False, verbose=False, analytics_enabled=False
        )
        self.voice_id = voice_id
        self.poll_s = poll_s
        self.clients: list = []

    async def prepare(self, clients: int) -> None:
        """Connect clients until there are ``clients`` of them."""
        missing = clients - len(self.clients)
        if missing > 0:
            with ThreadPoolExecutor(min(missing, 16)) as pool:
                self.clients += await asyncio.gather(
                    *(asyncio.wrap_future(pool.submit(self.make_client)) for _ in range(missing))
                )

    async def send(
        self, text: str, streaming: bool, seeds: list[int], on_done: OnDone
    ) -> list[RequestResult]:
        """One request per seed, all at once; ``on_done`` is called as each ends."""
        loop = asyncio.get_running_loop()
        api_name = "/speak" if streaming else "/speak_clip"
        return await asyncio.to_thread(
            self._run, text, api_name, seeds, lambda: loop.call_soon_threadsafe(on_done)
        )

    async def close(self) -> None:
        for client in self.clients:
            client.close()
        self.clients = []

    def _run(self, text: str, api_name: str, seeds: list[int], on_done: OnDone) -> list[RequestResult]:
        from cosyapp.web.ui.events import batch_failure

        starts, jobs = [], []
        for user, (client, seed) in enumerate(zip(self.clients[: len(seeds)], seeds, strict=True)):
            # The page's form: text, voice, recording, its transcript, speed, seed, session. Each
            # client sends a session id as a browser tab does, so fair admission tells them apart.
            starts.append(time.perf_counter())
            form = (text, self.voice_id, None, "", 1.0, seed, f"bench-{user}")
            jobs.append(client.submit(*form, api_name=api_name))
        results = [RequestResult() for _ in jobs]
        samples = [0] * len(jobs)
        seen = [0] * len(jobs)
        pending = set(range(len(jobs)))
        while pending:
            time.sleep(self.poll_s)
            now = time.perf_counter()
            for i in sorted(pending):
                finished = jobs[i].done()  # before reading the outputs, so none is missed
                outputs = jobs[i].outputs()
                for output in outputs[seen[i] :]:
                    total, rate = reported_samples(output)
                    if total > samples[i]:
                        results[i].chunks.append((now - starts[i], (total - samples[i]) / rate))
                        samples[i] = total
                seen[i] = len(outputs)
                if finished:
                    results[i].total = now - starts[i]
                    error = jobs[i].exception()
                    failure = batch_failure(stats_line(outputs[-1])) if outputs else None
                    if error is not None:
                        results[i].error = f"{type(error).__name__}: {error}"
                    elif failure is not None:  # failed inside a batch of several (README)
                        results[i].error = f"failed in a batch: {failure}"
                    pending.discard(i)
                    on_done()
        return results


def stats_line(output: object) -> object:
    """The stats line of a ``/speak`` or ``/speak_clip`` output (audio, stats, file); None otherwise."""
    return output[1] if isinstance(output, tuple) and len(output) == 3 else None


def reported_samples(output: object) -> tuple[int, int]:
    """(samples so far, sample rate) from the stats line of a ``/speak`` or ``/speak_clip`` output;
    (0, 1) for an output without one."""
    stats = stats_line(output)
    match = STATS_SAMPLES.search(stats) if isinstance(stats, str) else None
    if match is None:
        return 0, 1
    samples, rate = (int(group.replace(",", "")) for group in match.groups())
    return samples, rate
