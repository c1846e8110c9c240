"""vLLM's ``stream_interval`` (ServeOptions.lm_stream_interval): tokens handed on a few at a time,
the same tokens as one by one."""

import asyncio
import itertools

import pytest
import torch
from test_lm_vllm import (  # noqa: F401  (stop_controlled_model and vllm_caches are fixtures)
    ENGINE,
    MAX_MODEL_LEN,
    prompt,
    requires_vllm,
    stop_controlled_model,
    vllm_caches,
)

from cosyapp.engine.lm.base import LMRequest
from cosyapp.engine.lm.vllm_engine import VllmSpeechLM, export_for_vllm


@pytest.fixture(scope="class")
def interval_engines(loop, stop_controlled_model, tmp_path_factory):  # noqa: F811
    """Engines on the stop-controlled model in their own process: stream interval 1, then 4."""
    model = stop_controlled_model
    export = tmp_path_factory.mktemp("export")
    folder = export_for_vllm(model.lm, model.model_dir, export, dtype=torch.float32)
    engines = []
    try:
        for interval in (1, 4):
            engine = VllmSpeechLM(
                folder, model.lm.sampling, max_model_len=MAX_MODEL_LEN, stream_interval=interval, **ENGINE
            )
            engines.append(engine)
            loop.run_until_complete(engine.start())
        yield engines
    finally:
        for engine in engines:
            loop.run_until_complete(engine.shutdown())


@requires_vllm
class TestStreamInterval:
    def test_gathered_outputs_carry_the_same_tokens_on_the_intervals_grid(
        self,
        interval_engines,
        loop,
        stop_controlled_model,  # noqa: F811
    ):
        lm = stop_controlled_model.lm
        n = 30  # the stop-controlled model ends every request at min_tokens

        async def deltas(engine: VllmSpeechLM) -> list[list[list[int]]]:
            async def one(i: int) -> list[list[int]]:
                request = LMRequest(f"interval-{i}", prompt(lm, seed=70 + i), n, n, seed=300 + i)
                return [chunk async for chunk in engine.generate(request)]

            return await asyncio.gather(*(one(i) for i in range(3)))

        every, gathered = (loop.run_until_complete(deltas(engine)) for engine in interval_engines)
        for each, few in zip(every, gathered, strict=True):
            assert sum(each, []) == sum(few, []) and len(sum(few, [])) == n  # the same draws
            # The first token comes alone, then every 4th; an output the consumer took late merges
            # with the next, so each one ends on that grid (or at the request's end).
            ends = list(itertools.accumulate(len(chunk) for chunk in few))
            assert all(end == n or end % 4 == 1 for end in ends), ends
            assert len(few) <= 1 + -(-(n - 1) // 4)
