"""The serving loop never waits on CPU work: a long text's preparation and a voice upload's feature
extraction run beside the streams, not in their way.

Every stream of the process is driven by one event loop; a ticker task on it measures how late each
10 ms sleep wakes up (its lag), and a playing stream's chunk arrival times show whether its audio
kept coming.
"""

import asyncio
import contextlib
import time

from test_pipeline import parts  # noqa: F401  (the endless tiny model, its text frontend, a voice)

from cosyapp.engine.lm.torch_engine import TorchSpeechLM
from cosyapp.engine.pipeline import Pipeline, SynthesisRequest
from cosyapp.engine.token2wav.worker import Token2Wav

TICK = 0.01
# Dates, times, money, ordinals and percentages: every sentence goes through wetext's number rules.
UNIT = "On 3/14/2025 at 10:45 the $1,234.56 invoice no. 42 was paid by 7 people, 15% more than in 1999. "
LONG_TEXT = (UNIT * (5000 // len(UNIT)))[:4990]
# One sentence of 1,060 speech tokens on the endless model: 11 chunks, the first ones quick to compute.
PLAYING = "One two three four five six seven eight nine ten eleven twelve."
PLAYING_TOKENS = 1060


class Ticker:
    """Sleeps TICK again and again on the loop, recording (wake-up time, lag) of each sleep."""

    def __init__(self):
        self.ticks: list[tuple[float, float]] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self):
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(TICK)
            now = time.perf_counter()
            self.ticks.append((now, now - asked - TICK))

    def max_lag(self, start: float, end: float) -> float:
        return max(lag for woke, lag in self.ticks if start <= woke <= end)


def test_a_long_text_with_numbers_does_not_stall_another_stream(parts):  # noqa: F811
    model, text, voice = parts
    assert 20 * sum(len(s.ids) for s in text.prepare(PLAYING)) == PLAYING_TOKENS
    started = time.perf_counter()
    assert len(text.prepare(LONG_TEXT)) > 50
    blocking = time.perf_counter() - started  # how long preparing it on the loop would stall it

    async def main():
        pipeline = Pipeline(model, text, TorchSpeechLM(model.lm), Token2Wav(model))
        await pipeline.start()
        ticker = Ticker()
        arrivals: list[float] = []

        async def play():
            async with contextlib.aclosing(
                pipeline.stream(SynthesisRequest(PLAYING, voice, seed=1))
            ) as audio:
                async for _ in audio:
                    arrivals.append(time.perf_counter())

        player = asyncio.create_task(play())
        try:
            while not arrivals:
                await asyncio.sleep(TICK)
            submitted = time.perf_counter()
            long = pipeline.stream(SynthesisRequest(LONG_TEXT, voice, seed=2))
            first = asyncio.create_task(anext(long))
            # Admitted (a second active stream) once its first block and the voice are prepared; the
            # other blocks are prepared one ahead of its sentences, beside the streams too. Watch for
            # as long as preparing the whole text on the loop would have stalled it, at least until
            # the long request is admitted.
            while time.perf_counter() < submitted + blocking or (
                pipeline.health()["active_streams"] < 2 and not first.done()
            ):
                await asyncio.sleep(TICK)
            watched = time.perf_counter()
            first.cancel()  # the long request's audio is not needed: cancelling ends it
            await asyncio.wait([first])
            await long.aclose()
            assert not player.done(), "the playing stream must outlast the watch"
            return submitted, watched, ticker, arrivals
        finally:
            player.cancel()
            ticker.task.cancel()
            await asyncio.wait([player, ticker.task])
            await pipeline.shutdown()

    submitted, watched, ticker, arrivals = asyncio.run(main())
    assert blocking > 0.3  # long enough that preparing it on the loop would have stalled the stream
    assert ticker.max_lag(submitted, watched) < 0.1
    during = [t - submitted for t in arrivals if submitted <= t <= watched]
    assert during, f"no audio in {watched - submitted:.2f} s; chunks at {[t - submitted for t in arrivals]}"
