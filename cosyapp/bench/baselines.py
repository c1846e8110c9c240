"""The alternatives, on the same model, the same voice and the same text, in the same run:

(a) sequential serving: requests one after another on the plain PyTorch reference path
    (``ReferenceSynthesizer``), as a simple web demo does; whole clips;
(b) this run's LM engine with token2wav one request at a time (the design of a first vLLM port);
(c) the PyTorch LM engine with the batched token2wav worker;
and cosyapp's ratios to each, against (d) the full engine: the ``pipeline`` driver's level of the same
text at the top concurrency.
"""

import asyncio
import time
from collections.abc import Callable

from cosyapp.bench.drivers import PipelineDriver
from cosyapp.bench.levels import FIRST_SEED, measure
from cosyapp.bench.load import TextSet
from cosyapp.bench.reference import ReferenceSynthesizer
from cosyapp.bench.stats import RequestResult, summarize
from cosyapp.engine.pipeline import Pipeline
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.frontend.voices import Voice

SEQUENTIAL_NOTE = (
    "one request at a time: throughput does not depend on the number of clients, and each client "
    "waits for those before it, so its latency grows with their number (TTFA = whole clip)"
)


async def sequential_reference(
    pipeline: Pipeline, voice: Voice, text: TextSet, clients: int, on_done: Callable[[], None]
) -> dict:
    """Baseline (a): ``clients`` requests arriving at once, served one by one on the reference path,
    each with its own seed as in the other levels."""
    reference = ReferenceSynthesizer(pipeline.model, pipeline.text)
    results = []
    start = time.perf_counter()
    for i in range(clients):
        rate, wave = await asyncio.to_thread(reference.synthesize, text.text, voice, 1.0, FIRST_SEED + i)
        done = time.perf_counter() - start
        results.append(RequestResult(chunks=[(done, len(wave) / rate)], total=done))
        on_done()
    level = {"clients": clients, "streaming": False, "note": SEQUENTIAL_NOTE}
    return level | summarize(results, time.perf_counter() - start)


async def serial_token2wav(
    pipeline: Pipeline, voice: Voice, text: TextSet, clients: int, on_done: Callable[[], None]
) -> dict:
    """Baseline (b): the same LM engine, token2wav one chunk of one request at a time (streaming)."""
    t2w = pipeline.token2wav
    serial = Pipeline(
        pipeline.model,
        pipeline.text,
        pipeline.lm,
        Token2Wav(pipeline.model, max_batch=1, first_hop=t2w.first_hop, autocast_dtype=t2w.autocast_dtype),
        max_streams=pipeline.max_streams,
        max_waiting=pipeline.max_waiting,
    )
    await serial.start()  # the shared LM engine already runs; this starts the serial worker
    try:
        return await measure(PipelineDriver(serial, voice), text, True, clients, serial, on_done)
    finally:
        serial.token2wav.stop()


async def torch_engine(
    pipeline: Pipeline, voice: Voice, text: TextSet, clients: int, max_batch: int, on_done: Callable[[], None]
) -> dict:
    """Baseline (c): the PyTorch LM engine with this run's batched token2wav worker (streaming)."""
    from cosyapp.engine.lm.torch_engine import TorchSpeechLM

    if isinstance(pipeline.lm, TorchSpeechLM):
        return {"same_as": "(d): this run's LM engine is the PyTorch one"}
    other = Pipeline(
        pipeline.model,
        pipeline.text,
        TorchSpeechLM(pipeline.model.lm, max_batch=max_batch),
        pipeline.token2wav,
        max_streams=pipeline.max_streams,
        max_waiting=pipeline.max_waiting,
    )
    await other.start()  # starts the PyTorch engine; the token2wav worker already runs
    try:
        return await measure(PipelineDriver(other, voice), text, True, clients, other, on_done)
    finally:
        await other.lm.shutdown()


def requests(pipeline: Pipeline, baseline_clients: int, clients: int) -> int:
    """How many requests the baselines send ((c) sends none when this run's engine is the PyTorch one)."""
    from cosyapp.engine.lm.torch_engine import TorchSpeechLM

    return baseline_clients + clients + (0 if isinstance(pipeline.lm, TorchSpeechLM) else clients)


def add_ratios(baselines: dict[str, dict], reference: dict) -> None:
    """cosyapp's throughput over each baseline's, and each streaming baseline's TTFA p50 over
    cosyapp's when ``reference`` is a streaming level of the same concurrency."""
    for base in baselines.values():
        if not base.get("audio_per_wall_s"):  # (c) same as (d), or nothing measured
            continue
        base["cosyapp_throughput_ratio"] = reference["audio_per_wall_s"] / base["audio_per_wall_s"]
        comparable = base["streaming"] and reference["streaming"] and base["clients"] == reference["clients"]
        if comparable and base["ttfa_p50"] and reference["ttfa_p50"]:
            base["cosyapp_ttfa_p50_ratio"] = base["ttfa_p50"] / reference["ttfa_p50"]
