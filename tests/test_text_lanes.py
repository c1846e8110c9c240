"""The text frontend's lanes (engine/text_workers.py): requests that arrive together are prepared in
parallel lanes, each with its own thread, wetext process and frontend, and give the same model input
as one lane; a request keeps its lane; a closed request leaves no call counted."""

import asyncio

import pytest

from cosyapp.bench.load import bench_voice
from cosyapp.engine.text_workers import MAX_LANES, TextWorkers, default_lanes
from cosyapp.frontend.text import TextFrontend
from cosyapp.models.checkpoint import BACKBONE_DIR

# Numbers, an abbreviation and a date: wetext and the number speller both have work in each text.
TEXTS = [
    f"Order {n} shipped on March {n % 28 + 1}, 2024 at {n % 12 + 1}:15 pm. It weighed {n * 3.5} kg, "
    f"Dr. Smith said, and cost ${n * 17}. Then {n + 1000} more boxes followed. " * 3
    for n in range(1, 9)
]


@pytest.fixture(scope="module")
def frontend(tiny_model_dir):
    return TextFrontend(tiny_model_dir / BACKBONE_DIR)


def prepared(workers: TextWorkers, voice, texts: list[str]) -> tuple[list[tuple[list, list]], int]:
    """Every text's sentences' ids and its prompt's text ids, the texts prepared concurrently; and
    how many lanes served them (a lane's thread starts on its first call)."""

    async def one(text):
        sentences, prompt = await workers.prepare(text, voice)
        return [s.ids for s in [s async for s in sentences]], prompt.text_ids.tolist()

    async def main():
        try:
            results = await asyncio.gather(*(one(text) for text in texts))
            return results, sum(lane._thread is not None for lane in workers._lanes)
        finally:
            workers.close()

    return asyncio.run(main())


def test_a_host_gets_a_lane_per_four_cores_up_to_the_cap():
    assert [default_lanes(c) for c in (1, 2, 4, 7, 8, 16, 128)] == [1, 1, 1, 1, 2, 4, MAX_LANES]


def test_the_option_sets_the_pipelines_lanes(tiny_model):
    from cosyapp.engine.build import build_pipeline
    from cosyapp.options import ServeOptions

    assert build_pipeline(tiny_model, ServeOptions(engine="torch", text_lanes=3)).text_workers.lanes == 3
    auto = build_pipeline(tiny_model, ServeOptions(engine="torch"))
    assert auto.text_workers.lanes == default_lanes()


def test_concurrent_requests_use_several_lanes_and_get_what_one_lane_gives(frontend):
    voice = bench_voice(frontend)
    want, _ = prepared(TextWorkers(frontend, lanes=1), voice, TEXTS)
    workers = TextWorkers(frontend, lanes=3)
    got, lanes_used = prepared(workers, voice, TEXTS)
    assert got == want
    assert lanes_used > 1  # requests that arrived together did not queue in one lane
    assert all(lane.waiting == 0 for lane in workers._lanes)
    # Each lane speaks numbers with its own speller and encodes with its own tokenizer.
    spellers = {id(lane.frontend._inflect) for lane in workers._lanes}
    tokenizers = {id(lane.frontend.tokenizer) for lane in workers._lanes}
    assert len(spellers) == len(tokenizers) == 3


def test_a_closed_request_leaves_no_call_counted(frontend):
    voice = bench_voice(frontend)
    workers = TextWorkers(frontend, lanes=1)
    long_text = " ".join(TEXTS)[:4900]  # several blocks: the next one is prepared while one is read

    async def main():
        try:
            first, _ = await workers.prepare(long_text, voice)
            second, _ = await workers.prepare(long_text, voice)
            await anext(first)  # the first request's next block is being prepared ...
            await anext(second)  # ... so the second's waits behind it in the one lane
            await second.aclose()  # cancelled before it began: it never runs, and is counted out
            await first.aclose()  # this one's block finishes unread
            for _ in range(200):
                if all(lane.waiting == 0 for lane in workers._lanes):
                    return True
                await asyncio.sleep(0.05)
            return False
        finally:
            workers.close()

    assert asyncio.run(main())
